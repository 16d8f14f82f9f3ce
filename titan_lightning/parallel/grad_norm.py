"""The global gradient norm of a model sharded any way (DTensor shards, expert meshes, pipeline
stages), and clipping by it."""

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def global_grad_norm(grads: list[torch.Tensor], pp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The 2-norm of all gradients together, over every shard, accumulated in float64.

    fp32 accumulation over a large tensor is off by ~1e-5 relative on CPU, and differently
    for each way the tensor is split; in float64 every layout agrees with one process.
    Gradients live on several meshes under expert parallelism (dense and expert weights):
    each mesh's part is reduced over its own ranks, then the parts are combined. Under
    pipeline parallelism each rank holds some stages' gradients: ``pp_group`` sums the
    squares over the stages.
    """
    if not grads:
        total = torch.zeros((), dtype=torch.float64)
        if pp_group is not None:
            dist.all_reduce(total, group=pp_group)
        return total.float()
    groups: dict = {}
    for g in grads:
        key = g.device_mesh if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    parts = []
    for members in groups.values():
        norms = torch.stack([torch.linalg.vector_norm(g, 2.0, dtype=torch.float64) for g in members])
        part = torch.linalg.vector_norm(norms, 2.0)
        parts.append(part.full_tensor() if isinstance(part, DTensor) else part)
    total = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), 2.0)
    if pp_group is not None:
        squares = total.square()
        dist.all_reduce(squares, group=pp_group)
        total = squares.sqrt()
    return total.float()


@torch.no_grad()
def clip_grads_(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Multiply ``grads`` (in place) by min(max_norm / (norm + 1e-6), 1), computed on the device:
    no host sync. In float64, then rounded to float32 as a Python float would be: the same bits
    as the host computing it; a factor of exactly 1.0 leaves every gradient as it was."""
    coefficient = (max_norm / (norm.double() + 1e-6)).clamp(max=1.0).float()
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g  # (the DTensor's own storage)
        by_device.setdefault(local.device, []).append(local)
    for device, tensors in by_device.items():
        torch._foreach_mul_(tensors, coefficient.to(device, non_blocking=True))


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most ``max_norm``; return the norm before."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = global_grad_norm(grads, pp_group=pp_group)
    clip_grads_(grads, max_norm, norm)
    return norm
