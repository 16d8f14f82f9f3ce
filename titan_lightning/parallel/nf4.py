"""QLoRA's NF4 weights (torchao's ``NF4Tensor``) as the rest of the code meets them: whether a tensor
is one (or FSDP2's shard of one: a DTensor whose local block is NF4), and a full tensor written into
one, on one process or sharded.

NF4 quantizes a weight whole: a scale per 64 values, and those scales quantized per 256 around the
mean of all of them (one number for the whole tensor). A shard is therefore never quantized from its
own rows, as a dense shard is copied from its block (its mean would be its own): the full tensor is
quantized as one process quantizes it, then each rank keeps its rows (torchao splits an NF4Tensor on
dim 0 into its blocks' parts, and FSDP2 all-gathers them back into the whole one: its
``fsdp_pre_all_gather``). So the weights a sharded run computes with are the one-process run's, bit
for bit. torchao is imported only where an NF4 weight exists.
"""

from typing import Optional

import torch
from torch.distributed.tensor import DTensor


def is_nf4(t: object) -> bool:
    """torchao's NF4Tensor (checked by name: a run without QLoRA never imports torchao)."""
    return type(t).__name__ == "NF4Tensor"


def sharded_nf4(t: object) -> bool:
    """A DTensor whose local block is an NF4Tensor (an NF4 weight sharded by FSDP2)."""
    return isinstance(t, DTensor) and is_nf4(t._local_tensor)


def holds_nf4(t: object) -> bool:
    return is_nf4(t) or sharded_nf4(t)


def uneven_split(name: str, shape: tuple[int, ...], scale_blocks: int, shards: int) -> Optional[str]:
    """Why ``shards`` ranks cannot each keep whole rows and whole scale blocks of the NF4 weight
    ``name`` (``scale_blocks``: its groups of 256 (or fewer) block scales), or None when they can."""
    rows, columns = shape
    if rows % shards or scale_blocks % shards:
        return (f"lora.quantize_base='nf4' with parallelism.dp_shard={shards}: {name} [{rows}, {columns}] has "
                f"{rows} rows and {scale_blocks} NF4 scale blocks, which {shards} ranks cannot share evenly; set "
                f"dp_shard to a divisor of both")
    return None


def check_even_split(model: torch.nn.Module, shards: int) -> None:
    """Before FSDP2 shards ``model`` over ``shards`` ranks: a one-line ValueError for an NF4 weight
    they cannot split evenly (``uneven_split``; a ``dp_shard`` given before launch is checked then,
    by lora/rules.py, -1 only here)."""
    for name, param in model.named_parameters():
        if is_nf4(param):
            problem = uneven_split(name, tuple(param.shape), param.quantization_factor.numel(), shards)
            if problem is not None:
                raise ValueError(problem)


def local_rows(t: DTensor) -> tuple[int, int]:
    """(first row, rows) of the global tensor that this rank's block of ``t`` holds: FSDP2's (or
    HSDP's) even split of dim 0, worked out from the mesh alone (the estimator's tensors hold no values)."""
    start, rows = 0, t.shape[0]
    for placement, coordinate, size in zip(t.placements, t.device_mesh.get_coordinate(), t.device_mesh.shape):
        if placement.is_shard(0):
            rows //= size  # (even: check_even_split)
            start += coordinate * rows
    return start, rows


def _block(nf4: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The rows of the whole NF4 tensor ``nf4`` that this rank of ``like`` holds (an NF4Tensor)."""
    start, rows = local_rows(like)
    return nf4.split(rows)[start // rows]


def nf4_shard(nf4: torch.Tensor, like: DTensor) -> DTensor:
    """``_block`` as a DTensor placed as ``like``."""
    return DTensor.from_local(_block(nf4, like), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


@torch.no_grad()
def copy_into_sharded_nf4(target: DTensor, full: torch.Tensor) -> None:
    """``full`` (the whole tensor) into the NF4 weight sharded as ``target``: quantized whole, as one
    process's ``copy_`` into an NF4Tensor quantizes it, then this rank's rows copied into its block."""
    from torchao.dtypes.nf4tensor import to_nf4

    local = target._local_tensor
    nf4 = to_nf4(full.to(local.device).contiguous(), local.block_size, local.scaler_block_size)
    local.copy_(_block(nf4, target))


def stored_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold ``t``'s bytes: an NF4Tensor's packed 4-bit values, block scales, their
    scales, mean and lookup table; any other tensor itself."""
    if not is_nf4(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [getattr(t, name) for name in names]
