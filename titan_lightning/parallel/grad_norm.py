"""The global gradient norm of a model sharded any way (DTensor shards, expert meshes, pipeline
stages), and clipping by it."""

import functools
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


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
        if all(fused_square_sum_applies(g) for g in members):
            try:
                parts.append(_fused_norm(members))
                continue
            except Exception as error:  # noqa: BLE001 -- a compiler that cannot build it: aten's way
                _disable_fused_square_sum(error)
        norms = torch.stack([torch.linalg.vector_norm(g, 2.0, dtype=torch.float64) for g in members])
        part = torch.linalg.vector_norm(norms, 2.0)
        parts.append(part.full_tensor() if isinstance(part, DTensor) else part)
    total = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), 2.0)
    if pp_group is not None:
        squares = total.square()
        dist.all_reduce(squares, group=pp_group)
        total = squares.sqrt()
    return total.float()


# Where the fp64 norm reads each gradient once. ``linalg.vector_norm(g, dtype=float64)`` first
# writes a float64 copy of ``g`` and then reduces it (aten casts the input to a reduction's output
# type, except half -> float): 20 bytes moved per fp32 element instead of 4. On one H200 that was
# 14 ms of copies + 5.8 ms of reduction per step for 3.1B parameters (Qwen 3 30B-A3B layers,
# benchmarks/RESULTS.md). A compiled reduction casts in registers and accumulates in float64: the
# same sum up to the order of its float64 additions. Used on CUDA; the CPU keeps aten's kernels,
# whose results the golden files hold bit for bit.
FUSED_SQUARE_SUM_DEVICES = ("cuda",)
FUSED_SQUARE_SUM_BACKEND = "inductor"


def fused_square_sum_applies(g: torch.Tensor) -> bool:
    """Whether ``g``'s norm takes the compiled reduction: on a device of
    ``FUSED_SQUARE_SUM_DEVICES``, as a plain tensor or a DTensor sharded or replicated (each rank
    sums its own elements, the sharded mesh dimensions add the ranks' sums)."""
    if isinstance(g, DTensor):
        return g.device_mesh.device_type in FUSED_SQUARE_SUM_DEVICES and all(
            p.is_shard() or p.is_replicate() for p in g.placements)
    return g.device.type in FUSED_SQUARE_SUM_DEVICES


# Smaller tensors take aten's cast-then-reduce: cheap, and the compiled reduction then sees
# only sizes it does not specialize on (one graph per dtype).
FUSED_SQUARE_SUM_MIN_NUMEL = 1 << 16


@functools.cache
def _square_sum_fn(backend: str):
    def square_sum(flat: torch.Tensor) -> torch.Tensor:
        return flat.to(torch.float64).square().sum()

    return torch.compile(square_sum, backend=backend, dynamic=True, fullgraph=True)


def square_sum(t: torch.Tensor) -> torch.Tensor:
    """sum(t ** 2) accumulated in float64, large tensors read once (a compiled reduction)."""
    if t.numel() < FUSED_SQUARE_SUM_MIN_NUMEL:
        return torch.linalg.vector_norm(t, 2.0, dtype=torch.float64).square()
    return _square_sum_fn(FUSED_SQUARE_SUM_BACKEND)(t.reshape(-1))


def _disable_fused_square_sum(error: Exception) -> None:
    global FUSED_SQUARE_SUM_DEVICES
    FUSED_SQUARE_SUM_DEVICES = ()
    warnings.warn(f"the gradient norm's compiled reduction failed ({type(error).__name__}: {error}); "
                  f"using aten's float64 norm from now on (slower, same result)", stacklevel=3)


# Gradients smaller than this are read through one flat copy per dtype (in pieces of at most
# PACKED_MAX_NUMEL values), not one compiled call each: a call costs ~90 us of host time whatever
# the tensor's size, so LoRA's 448 adapter gradients of an 8B model took ~35 ms of the host per
# step for ~1 ms of device work (an H100 profile, benchmarks/RESULTS.md run 9), the device waiting.
# Larger ones are read in place: copying them would cost more device time than their call costs host.
PACKED_BELOW_NUMEL = 1 << 22
PACKED_MAX_NUMEL = 1 << 26


def _square_sums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The float64 sums of squares of ``tensors``' values (plain local tensors), together: large
    tensors one each, the small ones packed per dtype into flat pieces."""
    sums, pieces, filled = [], {}, {}
    for t in tensors:
        if t.numel() >= PACKED_BELOW_NUMEL:
            sums.append(square_sum(t).reshape(()))
            continue
        if t.dtype not in pieces or filled[t.dtype] + t.numel() > PACKED_MAX_NUMEL:
            pieces.setdefault(t.dtype, []).append([])
            filled[t.dtype] = 0
        pieces[t.dtype][-1].append(t.reshape(-1))
        filled[t.dtype] += t.numel()
    return sums + [square_sum(torch.cat(piece)).reshape(()) for per_dtype in pieces.values() for piece in per_dtype]


def _fused_norm(members: list[torch.Tensor]) -> torch.Tensor:
    """The float64 2-norm of ``members`` (plain tensors, or DTensors on one mesh): each rank's
    sums, then one all-reduce per placement pattern over the mesh dimensions that shard it."""
    by_placements: dict = {}
    for g in members:
        key = tuple(g.placements) if isinstance(g, DTensor) else None
        by_placements.setdefault(key, []).append(g.to_local() if isinstance(g, DTensor) else g)
    totals = []
    for key, locals_ in by_placements.items():
        total = torch.stack(_square_sums(locals_)).sum()
        if key is not None:
            placements = [Partial("sum") if p.is_shard() else Replicate() for p in key]
            total = DTensor.from_local(total, members[0].device_mesh, placements, run_check=False).full_tensor()
        totals.append(total)
    return torch.stack(totals).sum().sqrt()


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
