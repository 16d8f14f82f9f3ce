"""The names of a checkpoint folder's files (the layout: the package's docstring), and reading its
small ones (``meta.pt``; ``rank<r>.pt`` of the first format) with ``weights_only=True``: no code runs."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Optional

import torch

from titan_lightning.checkpoint.errors import CheckpointError, _describe

META = "meta.pt"
PARTIAL = ".partial"
DCP_METADATA = ".metadata"
# The manifest's key inside meta.pt, and the format it names: the folder holds exactly the files
# Lightning's ModelParallelStrategy writes (.metadata, __<rank>_0.distcp, meta.pt).
MANIFEST_KEY = "titan_lightning"
FORMAT = "titan_lightning/2"
# The first format (still read): the manifest in checkpoint.json, each rank's state in rank<r>.pt.
FORMAT_1 = "titan_lightning/1"
MANIFEST = "checkpoint.json"


def rank_file(rank: int) -> str:
    """A rank's own file in a checkpoint of the first format."""
    return f"rank{rank}.pt"


def _load_small(file: Path, *, weights_only: bool = True) -> Any:
    """A torch.save'd file of ours, with ``weights_only`` (no code runs); one line naming the file otherwise."""
    if not file.is_file():
        raise CheckpointError(f"checkpoint file {file} is missing")
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as error:
        text = " ".join(str(error).split())
        refused = text.split("Unsupported global: ")[-1].split(" was not")[0].removeprefix("GLOBAL ") if "Unsupported global" in text else None
        if refused:
            raise CheckpointError(
                f"checkpoint file {file} holds {refused}, which a weights-only load refuses (it could run code); "
                f"if you trust this file, allow the type with torch.serialization.add_safe_globals, or pass "
                f"weights_only as False to trainer.fit"
            ) from None
        raise CheckpointError(f"checkpoint file {file} is unreadable ({_describe(error)})") from None
    except (EOFError, RuntimeError, ValueError, OSError, UnicodeDecodeError, AttributeError) as error:
        raise CheckpointError(f"checkpoint file {file} is unreadable ({_describe(error)})") from None


def load_meta(path: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """Lightning's part of the checkpoint (loops, schedulers, callbacks, hyperparameters), without
    the manifest of ours it carries."""
    meta = _load_small(path / META, weights_only=weights_only)
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint file {path / META} holds a {type(meta).__name__}, not a checkpoint dict")
    meta.pop(MANIFEST_KEY, None)
    return meta


def load_rank_state(path: Path, rank: int, manifest: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """``rank``'s RNG states and data position: from the manifest (kept in meta.pt), or from
    ``rank<r>.pt`` in a checkpoint of the first format (``manifest`` None or without ``ranks``)."""
    if manifest is not None and manifest.get("format") == FORMAT:
        ranks = manifest.get("ranks")
        state = ranks[rank] if isinstance(ranks, list) and rank < len(ranks) else None
        where = f"checkpoint file {path / META}"
    else:
        state = _load_small(path / rank_file(rank))
        where = f"checkpoint file {path / rank_file(rank)}"
    if not isinstance(state, dict) or "rng" not in state:
        raise CheckpointError(f"{where} holds no state of rank {rank} (no 'rng')")
    return state

