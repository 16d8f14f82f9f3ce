"""Full (unsharded) weights into a sharded model: each tensor as a ``Source`` that reads blocks,
so a rank reads only the block of each DTensor it keeps (the Hugging Face importer streams
safetensors files through it)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from titan_lightning._compat import compute_local_shape_and_global_offset
from titan_lightning.checkpoint.placements import _one_chunk_placements
from titan_lightning.parallel.nf4 import copy_into_sharded_nf4, sharded_nf4


class Source:
    """One tensor of a checkpoint as a loader sees it: its global ``shape``, and ``read(index)``
    -> the block ``index`` of it (one ``slice`` per dim), so a rank reads only what it keeps."""

    def __init__(self, shape: tuple[int, ...], read: Callable[[tuple[slice, ...]], torch.Tensor]) -> None:
        self.shape, self.read = tuple(shape), read

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Source":
        return cls(tuple(tensor.shape), lambda index: tensor[index])

    def full(self) -> torch.Tensor:
        return self.read(tuple(slice(0, n) for n in self.shape))


def local_block(target: Any) -> Optional[tuple[slice, ...]]:
    """The block of the global tensor this rank holds of the DTensor ``target``, or None when its
    shard is several pieces (TP's ``colwise_fused``: read the whole tensor and shard it)."""
    if _one_chunk_placements(target) is not None:
        return None
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def load_sources(model: torch.nn.Module, sources: dict[str, Source], *, source: str = "state dict",
                 partial: bool = False) -> None:
    """Copy ``sources`` into ``model``'s parameters and buffers; a DTensor reads only its local block.

    Every key of the model must be in ``sources`` with the same global shape, and no other key;
    ``partial=True`` (a pipeline rank, which holds some stages) lets ``sources`` have more.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    own = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(sources)), sorted(set(sources) - set(own))
    if partial:
        unexpected = []
    if missing or unexpected:
        raise KeyError(f"{source} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, target in own.items():
        if sources[name].shape != tuple(target.shape):
            raise ValueError(f"{source}: {name} has shape {sources[name].shape}, the model's is {tuple(target.shape)}")
    for name, target in own.items():
        if sharded_nf4(target):  # (QLoRA under FSDP2: quantized whole, then this rank's rows)
            copy_into_sharded_nf4(target, sources[name].full().to(device=target.device, dtype=target.dtype))
        elif isinstance(target, DTensor):
            block = local_block(target)
            if block is None:
                full = sources[name].full().to(device=target.device, dtype=target.dtype)
                local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
            else:
                local = sources[name].read(block)
            target.to_local().copy_(local.to(device=target.device, dtype=target.dtype))
        else:
            target.copy_(sources[name].full().to(device=target.device, dtype=target.dtype))


def load_full_state_dict(
    model: torch.nn.Module, state: dict[str, torch.Tensor], *, source: str = "state dict", partial: bool = False
) -> None:
    """Copy full tensors into ``model``'s parameters and buffers, sharding DTensors locally
    (``load_sources`` of each tensor)."""
    load_sources(model, {name: Source.of(tensor) for name, tensor in state.items()}, source=source, partial=partial)
