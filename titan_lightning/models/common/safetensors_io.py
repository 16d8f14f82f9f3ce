"""Hugging Face safetensors checkpoints: the files, written whole and read by blocks.

Layout, as ``transformers`` writes and reads it:

    one file     <folder>/model.safetensors
    sharded      <folder>/model-00001-of-00003.safetensors ... and
                 <folder>/model.safetensors.index.json:
                 {"metadata": {"total_size": <bytes>}, "weight_map": {name: file, ...}}

Each file carries the metadata {"format": "pt"}, which ``transformers`` requires. Files are
written whole on the CPU; a sharded (DTensor) state dict must be gathered first. Reads parse the
headers as safetensors does and fetch only the bytes of the blocks asked for (``HFTensors``).
"""

import json
import math
import os
import re
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from safetensors.torch import save_file
from torch import Tensor

from titan_lightning.checkpoint.sources import Source

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

PathLike = Union[str, os.PathLike]


def shard_name(k: int, n: int) -> str:
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


def split_shards(state_dict: dict[str, Tensor], max_shard_bytes: int) -> list[dict[str, Tensor]]:
    """``state_dict`` as saveable tensors (``_standalone``) in files of at most ``max_shard_bytes``
    (tensors in their given order, none split; a larger tensor gets a file of its own); [] for {}."""
    seen: set[int] = set()
    shards: list[dict[str, Tensor]] = []
    size = 0
    for name, t in state_dict.items():
        t = _standalone(t, seen)
        if not shards or (shards[-1] and size + t.nbytes > max_shard_bytes):
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    return shards


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
    shards = split_shards(state_dict, max_shard_bytes) or [{}]
    weight_map = write_shards(shards, folder, first=0, total=len(shards))
    if len(shards) > 1:
        write_index(folder, weight_map, sum(t.nbytes for shard in shards for t in shard.values()))


def write_shards(shards: list[dict[str, Tensor]], folder: Path, *, first: int, total: int) -> dict[str, str]:
    """``shards`` as the files ``first + 1``.. of ``total`` in ``folder`` (``model.safetensors``
    when ``total`` is 1), with the metadata transformers requires; their name -> file map."""
    weight_map = {}
    for k, shard in enumerate(shards, start=first + 1):
        file = SINGLE_FILE if total == 1 else shard_name(k, total)
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    return weight_map


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def load_hf_safetensors(folder: PathLike) -> dict[str, Tensor]:
    """Every tensor of the checkpoint in ``folder`` (one file or an index and its shards), on the CPU."""
    tensors = HFTensors.open(folder)
    return {name: tensors.read(name) for name in tensors.keys()}


def _weight_map(folder: Path) -> Optional[dict[str, str]]:
    """The index's name -> file map, or None for a one-file checkpoint; one-line errors."""
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        if not (folder / SINGLE_FILE).is_file():
            raise FileNotFoundError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}: not a Hugging Face checkpoint folder")
        return None
    try:
        return dict(json.loads(index_path.read_text())["weight_map"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{index_path}: not a safetensors index with a 'weight_map' ({type(err).__name__}: {err})")


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class _Entry:
    """One tensor of a safetensors file: where its bytes are, and reads of blocks of it."""

    def __init__(self, path: Path, dtype: torch.dtype, shape: tuple[int, ...], begin: int) -> None:
        self.path, self.dtype, self.shape, self.begin = path, dtype, shape, begin

    def read(self, index: tuple[slice, ...]) -> Tensor:
        """The block ``index`` (slices of the leading dims): the rows it spans are read, then cut."""
        rows = index[0] if index else slice(0, self.shape[0] if self.shape else 1)
        row_numel = math.prod(self.shape[1:]) if self.shape else 1
        row_bytes = row_numel * self.dtype.itemsize
        count = max(rows.stop - rows.start, 0)
        buffer = torch.empty(count * row_bytes, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.begin + rows.start * row_bytes)
            if f.readinto(buffer.numpy()) != buffer.numel():
                raise ValueError(f"{self.path}: truncated (a tensor's bytes end past the file)")
        block = buffer.view(self.dtype).reshape(count, *self.shape[1:]) if self.shape else buffer.view(self.dtype)[0]
        rest = index[1:]
        return block[(slice(None), *rest)].clone() if any(_cuts(s, n) for s, n in zip(rest, self.shape[1:])) else block


def _cuts(s: slice, n: int) -> bool:
    return (s.start or 0) != 0 or (s.stop if s.stop is not None else n) != n


def _read_header(path: Path) -> dict[str, _Entry]:
    """The tensors a safetensors file declares, checked as safetensors does; one-line errors."""
    def corrupt(why: str) -> ValueError:
        return ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {why}")

    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise corrupt("shorter than its 8-byte header length")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise corrupt(f"header length {length} exceeds the file")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as err:
            raise corrupt(f"header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise corrupt("header is not a JSON object")
    header.pop("__metadata__", None)
    try:
        tensors = sorted((info["data_offsets"][0], name, info) for name, info in header.items())
    except (KeyError, TypeError, IndexError) as err:
        raise corrupt(f"a header entry lacks data_offsets ({err!r})") from None
    entries, end = {}, 0
    for _, name, info in tensors:
        begin, stop = info["data_offsets"]
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise corrupt(f"{name} has dtype {info.get('dtype')}, which this reader does not know")
        shape = tuple(info.get("shape", ()))
        if begin != end or stop - begin != math.prod(shape) * dtype.itemsize:
            raise corrupt(f"{name}'s bytes [{begin}, {stop}) do not follow the previous tensor or fit its shape")
        entries[name], end = _Entry(path, dtype, shape, 8 + length + begin), stop
    if 8 + length + end != size:
        raise corrupt(f"the tensors end at byte {8 + length + end}, the file at {size}")
    return entries


class HFTensors:
    """A checkpoint's tensors by Hugging Face name, read on demand: names and shapes from the file
    headers, values whole or as blocks (``read(name, index)``: only those bytes leave the file).
    ``HFTensors.of(state_dict)`` serves tensors in memory the same way."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Callable[[str, tuple[slice, ...]], Tensor]) -> None:
        self._shapes, self._read = shapes, read

    @classmethod
    def of(cls, state_dict: dict[str, Tensor]) -> "HFTensors":
        return cls({k: tuple(t.shape) for k, t in state_dict.items()}, lambda name, index: state_dict[name][index])

    @classmethod
    def open(cls, folder: PathLike) -> "HFTensors":
        """The checkpoint in ``folder`` (one file, or an index and its shards), headers read, no
        tensor. Blocks are read with positioned reads of the rows they span, not through a memory
        map, so a rank's resident memory holds what it reads and nothing of the rest."""
        folder = Path(folder)
        weight_map = _weight_map(folder)
        files = [SINGLE_FILE] if weight_map is None else list(dict.fromkeys(weight_map.values()))
        entries: dict[str, _Entry] = {}
        for file in files:
            path = folder / file
            if not path.is_file():
                raise FileNotFoundError(f"{path}: checkpoint file is missing" + (f" (listed in {INDEX_FILE})" if weight_map else ""))
            header = _read_header(path)
            if weight_map is not None:
                listed = {name for name, f in weight_map.items() if f == file}
                if listed != header.keys():
                    missing, extra = sorted(listed - header.keys()), sorted(header.keys() - listed)
                    raise ValueError(f"{path}: tensors do not match {INDEX_FILE}: missing {missing}, not listed {extra}")
            entries.update(header)
        return cls({name: entry.shape for name, entry in sorted(entries.items())},
                   lambda name, index: entries[name].read(index))

    def keys(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str, index: tuple[slice, ...] = ()) -> Tensor:
        """The tensor ``name``, or its block ``index`` (one slice per leading dim)."""
        return self._read(name, index)

    def source(self, name: str) -> Source:
        return Source(self.shape(name), lambda index: self.read(name, index))

