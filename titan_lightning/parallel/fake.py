"""The fake process group: one process plays rank `rank` of `world_size`.

Collectives return at once without moving data, so a run exercises the mesh, the
sharding and the program logic of any world size on one device. Its numbers are a
deterministic synthetic contract, not real training values.
"""

from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def init_fake_process_group(rank: int, world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ValueError(f"fake process group rank={rank} must be in [0, {world_size})")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
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
