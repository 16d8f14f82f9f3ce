"""Hugging Face safetensors checkpoints: the files, and the state-dict adapters that rename.

Layout, as ``transformers`` writes and reads it:

    one file     <folder>/model.safetensors
    sharded      <folder>/model-00001-of-00003.safetensors ... and
                 <folder>/model.safetensors.index.json:
                 {"metadata": {"total_size": <bytes>}, "weight_map": {name: file, ...}}

Each file carries the metadata {"format": "pt"}, which ``transformers`` requires. Files are
written whole on the CPU; a sharded (DTensor) state dict must be gathered first.

A model family's ``StateDictAdapter`` maps its own parameter names and layouts to
Hugging Face's (``to_hf``) and back (``from_hf``); ``load_into`` and ``save_from`` join
that to the files, with strict key and shape checks.
"""

import json
import os
import re
from pathlib import Path
from typing import Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

PathLike = Union[str, os.PathLike]


def _shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def _standalone(t: Tensor, seen: set[int]) -> Tensor:
    """``t`` on the CPU, contiguous, owning its whole storage and sharing it with no other
    tensor saved (safetensors refuses views, e.g. one expert of a stacked weight)."""
    t = t.detach().cpu()
    ptr = t.untyped_storage().data_ptr()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes or ptr in seen:
        t = t.clone(memory_format=torch.contiguous_format)
    seen.add(t.untyped_storage().data_ptr())
    return t


def save_hf_safetensors(state_dict: dict[str, Tensor], folder: PathLike, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``state_dict`` as one ``model.safetensors``, or, when it is larger than
    ``max_shard_bytes``, as numbered shards (tensors in their given order, none split) and an index.

    Checkpoint files of an earlier save in ``folder`` (``model.safetensors``, the index,
    ``model-*-of-*.safetensors``) are removed first, so no stale shard or index survives.
    """
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} must be a positive integer")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        if old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.fullmatch(old.name):
            old.unlink()
    seen: set[int] = set()
    tensors = {name: _standalone(t, seen) for name, t in state_dict.items()}
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / SINGLE_FILE), metadata=metadata)
        return
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        file = _shard_name(k, len(shards))
        save_file(shard, str(folder / file), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _load_file(path: Path, context: str = "") -> dict[str, Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint file is missing{context}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        reason = " ".join(str(err).split())
        raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {reason}") from None


def load_hf_safetensors(folder: PathLike) -> dict[str, Tensor]:
    """Every tensor of the checkpoint in ``folder`` (one file or an index and its shards), on the CPU."""
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        if not (folder / SINGLE_FILE).is_file():
            raise FileNotFoundError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}: not a Hugging Face checkpoint folder")
        return _load_file(folder / SINGLE_FILE)
    try:
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{index_path}: not a safetensors index with a 'weight_map' ({type(err).__name__}: {err})")
    state_dict: dict[str, Tensor] = {}
    for file in dict.fromkeys(weight_map.values()):
        tensors = _load_file(folder / file, context=f" (listed in {INDEX_FILE})")
        listed = {name for name, f in weight_map.items() if f == file}
        if listed != tensors.keys():
            missing, extra = sorted(listed - tensors.keys()), sorted(tensors.keys() - listed)
            raise ValueError(
                f"{folder / file}: tensors do not match {INDEX_FILE}: missing {missing}, not listed {extra}"
            )
        state_dict.update(tensors)
    return state_dict


def check_keys(expected: dict[str, Tensor], got: dict[str, Tensor], what: str) -> None:
    """Raise one line naming the missing and unexpected keys, or the first shape that differs."""
    missing, unexpected = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{what}: missing keys {_names(missing)}; unexpected keys {_names(unexpected)}")
    for name, t in expected.items():
        if tuple(got[name].shape) != tuple(t.shape):
            raise ValueError(f"{what}: {name} has shape {tuple(got[name].shape)}, the model has {tuple(t.shape)}")


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return f"[{shown}{f', ... ({len(keys)} in all)' if len(keys) > limit else ''}]"


class StateDictAdapter:
    """Converts one model family's state dict to Hugging Face names and layouts and back.

    Subclasses implement ``to_hf`` and ``from_hf``, each the inverse of the other, raising on
    a key they cannot map. ``load_into``/``save_from`` work on an unsharded model whose
    tensors are materialized (not on the meta device); values are cast to the model's dtype.
    """

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must implement to_hf()")

    def from_hf(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must implement from_hf()")

    @torch.no_grad()
    def load_into(self, model: nn.Module, folder: PathLike) -> None:
        """Load the Hugging Face checkpoint in ``folder`` into ``model``; every key must match."""
        state_dict = self.from_hf(load_hf_safetensors(folder))
        check_keys(model.state_dict(), state_dict, f"loading {folder} into {type(model).__name__}")
        model.load_state_dict(state_dict, strict=True)

    def save_from(self, model: nn.Module, folder: PathLike, max_shard_bytes: int = 5 * 2**30) -> None:
        """Save ``model`` as a Hugging Face checkpoint in ``folder``."""
        save_hf_safetensors(self.to_hf(model.state_dict()), folder, max_shard_bytes)
