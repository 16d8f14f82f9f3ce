"""Shards DCP cannot describe.

DCP records each rank's shard of a DTensor as one block of the global tensor (an offset and a
size per dim). A ``_StridedShard`` may give a rank several pieces instead: TP's
``colwise_fused:N`` gives rank r its part of each of N blocks of rows ([q_r; k_r; v_r]), which
DCP would place wrongly (its save refuses: "overlapping chunks"). Such a DTensor is saved and
read replicated along the dims it splits into pieces: the unsplit rows, in the module's own
layout, which every other layout reads.
"""

from __future__ import annotations

from typing import Any, Optional

from titan_lightning._compat import StridedShard
from titan_lightning.checkpoint.errors import CheckpointError


def dcp_saveable(state: Any, name: str = "") -> Any:
    """``state`` (nested dicts and lists; not changed) with each DTensor whose shard is several
    pieces replaced by the same values replicated along those dims (a collective on its mesh)."""
    if isinstance(state, dict):
        return {key: dcp_saveable(value, str(key)) for key, value in state.items()}
    if isinstance(state, list):
        return [dcp_saveable(value, name) for value in state]
    placements = _one_chunk_placements(state, name)
    return state if placements is None else state.detach().redistribute(state.device_mesh, placements)


def _dtensor_slots(state: Any):
    """(container, key, DTensor) for every DTensor in nested dicts and lists."""
    from torch.distributed.tensor import DTensor

    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for key, value in items:
        if isinstance(value, DTensor):
            yield state, key, value
        else:
            yield from _dtensor_slots(value)


def check_placements(named_tensors: Any) -> None:
    """Raise CheckpointError for a (name, DTensor) whose placements do not say where its shards
    are (see ``_check_described``); before a full state dict is gathered or loaded."""
    for name, value in named_tensors:
        _check_described(value, name)


def _check_described(value: Any, name: str) -> None:
    """FSDP on top of a ``_StridedShard`` (TP's ``colwise_fused``) gives a second ``_StridedShard``
    on the same dim, computed as if TP's shard were one block: the placements no longer say which
    rows a rank holds (training is right: FSDP gathers back what it split), so the full tensor,
    a full state dict and any checkpoint of it would hold the rows out of order."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return
    strided = [p.dim for p in value.placements if isinstance(p, StridedShard)]
    if len(strided) > len(set(strided)):
        raise CheckpointError(
            f"{name} {tuple(value.shape)}: FSDP (parallelism.dp_shard > 1) over the TP style 'colwise_fused' gave "
            f"it placements {tuple(value.placements)} that do not say where its rows are, so a checkpoint of it "
            f"would hold them out of order; checkpoint such a model with parallelism.dp_shard=1 (TP alone), or "
            f"group its rows per head and use the TP style 'colwise'"
        )


def _one_chunk_placements(value: Any, name: str = "") -> Optional[tuple]:
    """For a DTensor whose shard on a rank may be several pieces, its placements with those dims
    replicated; None for any other value. Decided from the placements alone (the same on every rank).

    A ``_StridedShard(d, split_factor=f)`` splits dim d into f blocks and gives each rank a piece
    of every block: one piece only when later mesh dims split d into exactly f parts (FSDP's form
    over TP's plain shards, which DCP reads); any other use is several pieces."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(value, DTensor):
        return None
    _check_described(value, name)
    placements, sizes = value.placements, value.device_mesh.shape
    splits = lambda p, dim: isinstance(p, (Shard, StridedShard)) and p.dim == dim  # noqa: E731
    in_pieces = set()
    for index, strided in enumerate(placements):
        if isinstance(strided, StridedShard):
            parts = 1
            for later, size in zip(placements[index + 1:], sizes[index + 1:]):
                parts *= size if splits(later, strided.dim) else 1
            if parts != strided.split_factor:
                in_pieces.add(strided.dim)
    if not in_pieces:
        return None
    return tuple(Replicate() if any(splits(p, dim) for dim in in_pieces) else p for p in placements)
