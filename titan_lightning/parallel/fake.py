"""The fake process group: one process plays rank `rank` of `world_size`.

Collectives return at once without moving data, so a run exercises the mesh, the
sharding and the program logic of any world size on one device. Its numbers are a
deterministic synthetic contract, not real training values.
"""

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_lightning._compat import fake_store, funcol, resolve_process_group
from titan_lightning.parallel.nf4 import stored_tensors


def init_fake_process_group(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"fake process group rank={rank} must be in [0, {world_size})")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)


class deterministic_collectives:
    """While active, collectives under the fake group write "as if every rank held this
    rank's input": a reduce-scatter returns the rank's own chunk (times the group size for
    a sum), an all-gather returns the rank's input repeated once per rank, an all-to-all
    returns the rank's own input (cycled to the output's size where the splits differ).

    torch's fake group leaves these outputs unwritten, so FSDP parameters, gradients and
    sequence-parallel activations would be whatever memory held (NaN on some versions and
    devices, allocator-dependent garbage on others). This patches the module-level entry
    points FSDP2 and DTensor call, under the names each supported torch version uses
    (``all_gather_into_tensor``/``all_gather_tensor`` on 2.11, ``all_gather_single`` on
    2.13), and restores them on exit.
    """

    _DIST = {
        "reduce_scatter_single": "_wrap_dist_reduce_scatter",
        "reduce_scatter_tensor": "_wrap_dist_reduce_scatter",
        "all_gather_single": "_wrap_dist_all_gather",
        "all_gather_into_tensor": "_wrap_dist_all_gather",
    }
    _FUNCOL = {
        "reduce_scatter_single": "_wrap_funcol_reduce_scatter",
        "reduce_scatter_tensor": "_wrap_funcol_reduce_scatter",
        "all_gather_single": "_wrap_funcol_all_gather",
        "all_gather_tensor": "_wrap_funcol_all_gather",
        "all_to_all_single": "_wrap_funcol_all_to_all",
    }

    def __enter__(self):
        self._saved = []
        for module, names in ((dist, self._DIST), (funcol, self._FUNCOL)):
            for name, wrapper in names.items():
                original = getattr(module, name, None)
                if original is not None:
                    self._saved.append((module, name, original))
                    setattr(module, name, globals()[wrapper](original))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)


def _own_chunk(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    size = dist.get_world_size(group)
    return tensor.chunk(size, dim=dim)[dist.get_rank(group)], size


def _process_group(group) -> dist.ProcessGroup:
    """Every form functional collectives accept: a mesh, (mesh, dim), a group or its name."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        return group.get_group()
    if isinstance(group, tuple) and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    if isinstance(group, str):
        return resolve_process_group(group)
    return group


def _wrap_dist_reduce_scatter(original):
    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, **kwargs):
        work = original(output, input, op=op, group=group, async_op=async_op, **kwargs)
        chunk, size = _own_chunk(input, group)
        output.copy_(chunk.reshape(output.shape) * (size if op == dist.ReduceOp.SUM else 1))
        return work

    return reduce_scatter


def _wrap_funcol_reduce_scatter(original):
    def reduce_scatter(self, reduceOp, scatter_dim, group, tag=""):
        funcol.wait_tensor(original(self, reduceOp, scatter_dim, group, tag))  # keeps its checks
        chunk, size = _own_chunk(self, _process_group(group), dim=scatter_dim)
        return chunk.contiguous() * (size if reduceOp.lower() == "sum" else 1)

    return reduce_scatter


def _wrap_dist_all_gather(original):
    def all_gather(output_tensor, input_tensor, group=None, async_op=False, **kwargs):
        source = input_tensor.detach().clone()  # FSDP's input is a view into the output
        work = original(output_tensor, input_tensor, group=group, async_op=async_op, **kwargs)
        size = dist.get_world_size(group)
        output_tensor.view(size, -1).copy_(source.reshape(1, -1).expand(size, -1))
        return work

    return all_gather


def _wrap_funcol_all_gather(original):
    def all_gather(self, gather_dim, group, tag=""):
        funcol.wait_tensor(original(self, gather_dim, group, tag))  # keeps its checks
        size = dist.get_world_size(_process_group(group))
        return torch.cat([self] * size, dim=gather_dim)

    return all_gather


def _wrap_funcol_all_to_all(original):
    def all_to_all(self, output_split_sizes, input_split_sizes, group, tag=""):
        funcol.wait_tensor(original(self, output_split_sizes, input_split_sizes, group, tag))  # keeps its checks
        rows = self.shape[0] if output_split_sizes is None else sum(output_split_sizes)
        shape = (rows, *self.shape[1:])
        flat = self.reshape(-1)
        need = rows * math.prod(self.shape[1:])
        if flat.numel() == 0 or need == 0:
            return self.new_zeros(shape)
        return flat.repeat(-(-need // flat.numel()))[:need].reshape(shape)

    return all_to_all


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += sum(s.numel() * s.element_size() for s in stored_tensors(local))  # (an NF4 weight: its parts)
    return total


def memory_report(model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards)."""
    params = list(model.parameters())
    states = [
        value
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]
    return {
        "parameters": _local_bytes(params),
        "gradients": _local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": _local_bytes(states),
    }
