"""Token shards: a corpus tokenized once (``titan-lightning prepare``), read through memory maps.

A shard set is a folder::

    index.json          {"format": "titan-lightning-tokens", "version": 1, "dtype": "uint16",
                         "tokenizer": {"sha256", "vocab_size", "eos_id", "bos_id"}, "max_id": M,
                         "shards": [{"name": "part-00000-00000", "tokens": T, "documents": D,
                                     "max_id": M}, ...]}
    <name>.tokens       the token ids, little-endian ``dtype`` (uint16 up to 65,536 ids, else
                        uint32), documents back to back, each ending with the tokenizer's EOS
                        (and starting with its BOS when its tokenizer_config.json says so)
    <name>.docs         little-endian int64: each document's end offset in its shard
    <name>.mask         (chat and instruction data only) uint8, one byte per token: 1 where the token
                        is a supervised target; the index then has ``"loss_mask": true`` and an
                        ``"sft"`` object (what was trained on, conversations truncated and dropped)

A reader holds the index and, per shard, a memory map it opens on first use: its memory and
start-up time do not grow with the corpus. ``index.json`` is written last, so a folder without
it is not a shard set (an unfinished ``prepare`` resumes from its ``progress.json``).

``max_id`` (the largest token id written) lets a run check its model's vocabulary before launch;
a set written before it was recorded is scanned instead (all of it, or ``SCAN_TOKENS`` spread
over its shards).
"""

import hashlib
import json
import os
from bisect import bisect_right
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from titan_lightning.data.tokenizer import check_token_ids

FORMAT = "titan-lightning-tokens"
VERSION = 1
INDEX = "index.json"
PathLike = Union[str, Path]
DTYPES = ("uint16", "uint32")
SCAN_TOKENS = 2**26  # tokens read to find the largest id of a set whose index does not record it


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def tokenizer_identity(tokenizer_json: Path, vocab_size: int, eos_id: int, bos_id: Optional[int]) -> dict[str, Any]:
    """What a shard set records of the tokenizer that wrote it (its file's hash and special ids)."""
    digest = hashlib.sha256(Path(tokenizer_json).read_bytes()).hexdigest()
    return {"sha256": digest, "vocab_size": vocab_size, "eos_id": eos_id, "bos_id": bos_id}


def is_shard_set(path: PathLike) -> bool:
    return (Path(path) / INDEX).is_file()


class ShardWriter:
    """Writes the documents of one part of a corpus as one or more shards named ``<part>-NNNNN``;
    with a loss mask per document (chat data), each shard's ``.mask`` next to its ``.tokens``."""

    def __init__(self, folder: Path, part: str, dtype: np.dtype, shard_tokens: int = 2**28) -> None:
        self.folder, self.part, self.dtype, self.shard_tokens = folder, part, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file = None
        self._mask_file = None
        self._masked: Optional[bool] = None  # set by the first document: all of a writer's have a mask or none
        self._ends: list[int] = []
        self._tokens = 0
        self._supervised = 0
        self._max_id = -1

    def add(self, ids: np.ndarray, mask: Optional[np.ndarray] = None) -> None:
        """One document's token ids (EOS, and BOS, already in place); ``mask``: 1 per supervised
        target token, 0 elsewhere, as long as ``ids``."""
        if self._masked is None:
            self._masked = mask is not None
        if self._masked != (mask is not None) or (mask is not None and len(mask) != len(ids)):
            raise ValueError(f"ShardWriter.add: a mask of {None if mask is None else len(mask)} for {len(ids)} "
                             f"tokens; every document of a shard set has a mask as long as its ids, or none has")
        if self._file is None or self._tokens >= self.shard_tokens:
            self._close_shard()
            name = f"{self.part}-{len(self.shards):05d}"
            self.shards.append({"name": name, "tokens": 0, "documents": 0})
            self._file = open(self.folder / f"{name}.tokens", "wb")
            if self._masked:
                self._mask_file = open(self.folder / f"{name}.mask", "wb")
        self._file.write(np.asarray(ids, dtype=self.dtype).tobytes())
        if mask is not None:
            mask = np.asarray(mask, dtype=np.uint8)
            self._mask_file.write(mask.tobytes())
            self._supervised += int(np.count_nonzero(mask))
        self._tokens += len(ids)
        if len(ids):
            self._max_id = max(self._max_id, int(np.max(ids)))
        self._ends.append(self._tokens)

    def _close_shard(self) -> None:
        if self._file is None:
            return
        self._file.close()
        if self._mask_file is not None:
            self._mask_file.close()
        shard = self.shards[-1]
        np.asarray(self._ends, dtype="<i8").tofile(self.folder / f"{shard['name']}.docs")
        shard["tokens"], shard["documents"], shard["max_id"] = self._tokens, len(self._ends), self._max_id
        if self._masked:
            shard["supervised"] = self._supervised  # tokens whose mask is 1
        self._file, self._mask_file, self._ends, self._tokens, self._max_id = None, None, [], 0, -1
        self._supervised = 0

    def close(self) -> list[dict[str, Any]]:
        self._close_shard()
        return self.shards


def write_index(folder: Path, dtype: np.dtype, tokenizer: dict[str, Any], shards: list[dict[str, Any]],
                sources: Optional[list[str]] = None, sft: Optional[dict[str, Any]] = None) -> None:
    """``index.json``, last; ``sft`` (chat data, its shards written with masks): what prepare trained
    on and counted (``"loss_mask": true`` marks the set)."""
    index = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "tokenizer": tokenizer,
             "total_tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
             "shards": shards, "sources": sources or []}
    if sft is not None:
        index["loss_mask"], index["sft"] = True, sft
    if all("max_id" in s for s in shards):
        index["max_id"] = max((s["max_id"] for s in shards), default=-1)
    partial = folder / (INDEX + ".partial")
    partial.write_text(json.dumps(index, indent=1) + "\n")
    partial.replace(folder / INDEX)


class TokenSpan:
    """Tokens ``start``..``stop`` of a shard set as one array: ``len``, and ``span[a:b]`` -> a
    NumPy int64 copy of those tokens, read from the shards' memory maps."""

    def __init__(self, shards: "ShardSet", start: int, stop: int) -> None:
        self.shards, self.start, self.stop = shards, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: slice) -> np.ndarray:
        a, b, step = index.indices(len(self))
        if step != 1:
            raise ValueError("TokenSpan slices take step 1")
        return self.shards.read(self.start + a, self.start + max(a, b))


class ShardSet:
    """A shard set opened for reading (see the module docstring); ``tokens`` spans all of it."""

    def __init__(self, folder: PathLike, field: str = "data.dataset_path") -> None:
        self.folder = Path(folder)
        where = f"{field}={str(folder)!r}"
        try:
            index = json.loads((self.folder / INDEX).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{where}: {INDEX} unreadable ({' '.join(str(err).split())})") from None
        if index.get("format") != FORMAT or index.get("version") != VERSION:
            raise ValueError(f"{where}: {INDEX} is not a titan-lightning token shard index (format {FORMAT} "
                             f"version {VERSION}); write one with `titan-lightning prepare`")
        if index.get("dtype") not in DTYPES:
            raise ValueError(f"{where}: {INDEX} has dtype={json.dumps(index.get('dtype'))}; token shards are "
                             f"{' or '.join(DTYPES)} (a foreign or hand-edited index: write one with "
                             f"`titan-lightning prepare`)")
        self.index, self.dtype = index, np.dtype(index["dtype"]).newbyteorder("<")
        self.tokenizer: dict[str, Any] = index["tokenizer"]
        self.names = [s["name"] for s in index["shards"]]
        counts = [int(s["tokens"]) for s in index["shards"]]
        self.offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        for name, count in zip(self.names, counts):
            file = self.folder / f"{name}.tokens"
            if not file.is_file() or file.stat().st_size != count * self.dtype.itemsize:
                size = file.stat().st_size if file.is_file() else None
                raise ValueError(f"{where}: {file.name} holds {size} bytes, the index says {count} tokens "
                                 f"of {self.dtype.name} (a truncated or foreign file)")
            if not os.access(file, os.R_OK):
                raise ValueError(f"{where}: {file.name} cannot be read (permission denied); make the shard files "
                                 f"readable by this user")
            mask = self.folder / f"{name}.mask"
            if self.has_mask and (not mask.is_file() or mask.stat().st_size != count):
                size = mask.stat().st_size if mask.is_file() else None
                raise ValueError(f"{where}: {mask.name} holds {size} bytes, the index says {count} tokens (one "
                                 f"mask byte each; a truncated or missing file: prepare the set again)")
        self._maps: dict[tuple[str, int], np.ndarray] = {}

    def __len__(self) -> int:
        return self.offsets[-1]

    @property
    def tokens(self) -> TokenSpan:
        return TokenSpan(self, 0, len(self))

    @property
    def has_mask(self) -> bool:
        """Whether the set carries a per-token loss mask (``"loss_mask": true``: SFT data)."""
        return bool(self.index.get("loss_mask", False))

    def _map(self, k: int, kind: str = "tokens") -> np.ndarray:
        """Shard ``k``'s ``.tokens``, ``.mask`` or ``.docs`` file, memory-mapped on first use."""
        if (kind, k) not in self._maps:
            dtype = {"tokens": self.dtype, "mask": np.dtype("u1"), "docs": np.dtype("<i8")}[kind]
            file = self.folder / f"{self.names[k]}.{kind}"
            count = (self.offsets[k + 1] - self.offsets[k]) if kind != "docs" else file.stat().st_size // 8
            self._maps[(kind, k)] = np.memmap(file, dtype=dtype, mode="r", shape=(count,)) if count else \
                np.empty(0, dtype)
        return self._maps[(kind, k)]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Global tokens ``start``..``stop`` (across shard borders) as int64."""
        return self._read(start, stop, "tokens", np.int64)

    def read_mask(self, start: int, stop: int) -> np.ndarray:
        """The loss mask of global tokens ``start``..``stop`` as uint8 (a set with ``has_mask``)."""
        if not self.has_mask:
            raise ValueError(f"{self.folder} has no loss mask (its index has no \"loss_mask\": true)")
        return self._read(start, stop, "mask", np.uint8)

    def _read(self, start: int, stop: int, kind: str, dtype) -> np.ndarray:
        out = np.empty(stop - start, dtype=dtype)
        k, filled = bisect_right(self.offsets, start) - 1, 0
        while filled < len(out):
            lo = start + filled - self.offsets[k]
            take = min(self.offsets[k + 1] - self.offsets[k] - lo, len(out) - filled)
            out[filled:filled + take] = self._map(k, kind)[lo:lo + take]
            if kind == "tokens":  # the ids its index vouches for (an edited file: named, not an IndexError)
                check_token_ids(out[filled:filled + take], self.index.get("max_id"),
                                self.folder / f"{self.names[k]}.tokens", lo)
            filled, k = filled + take, k + 1
        return out

    def document_ends(self, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """The global end offsets of the documents that end in ``(start, stop]`` (default: all),
        ascending int64, from the ``.docs`` files (never from scanning for EOS)."""
        stop = len(self) if stop is None else stop
        first = min(max(bisect_right(self.offsets, start) - 1, 0), len(self.names) - 1)
        parts = []
        for k in range(first, len(self.names)):
            if self.offsets[k] >= stop:
                break
            ends = self.offsets[k] + np.asarray(self._map(k, "docs"), dtype=np.int64)
            parts.append(ends[(ends > start) & (ends <= stop)])
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def document_end_before(self, position: int) -> int:
        """The last document end at or before global token ``position`` (0 if none)."""
        k = min(max(bisect_right(self.offsets, position) - 1, 0), len(self.names) - 1)
        while k >= 0:
            ends = self._map(k, "docs")
            local = position - self.offsets[k]
            i = int(np.searchsorted(ends, local, side="right"))
            if i:
                return self.offsets[k] + int(ends[i - 1])
            k -= 1
        return 0

    def max_id(self) -> int:
        """The largest token id: the index's, else that of a scan of every token, or of
        ``SCAN_TOKENS`` of them (the first of each shard) for a larger set."""
        if isinstance(self.index.get("max_id"), int):
            return self.index["max_id"]
        each, found = max(SCAN_TOKENS // max(len(self.names), 1), 1), -1
        for k in range(len(self.names)):
            tokens = self._map(k)[:each]
            for start in range(0, len(tokens), 2**22):
                found = max(found, int(tokens[start:start + 2**22].max()))
        return found

    def check_vocab(self, vocab_size: int, field: str = "data.dataset_path") -> None:
        """One line when a token id is not below ``vocab_size`` (the model's embedding would fail)."""
        largest = self.max_id()
        if largest >= vocab_size:
            where = "the index records" if "max_id" in self.index else "a scan found"
            raise ValueError(f"{field}={str(self.folder)!r} holds token id {largest} ({where} it), out of range for "
                             f"model.vocab_size={vocab_size}; use a model with vocab_size > {largest}, or prepare "
                             f"the shards with the model's tokenizer")

    def check_tokenizer(self, expected: dict[str, Any], field: str = "data.tokenizer_path") -> None:
        """One line when this set was written by another tokenizer than ``expected``."""
        mine = {k: self.tokenizer.get(k) for k in ("sha256", "eos_id", "bos_id")}
        theirs = {k: expected.get(k) for k in mine}
        if mine != theirs:
            raise ValueError(f"the shards in {self.folder} were written by another tokenizer (sha256 "
                             f"{str(mine['sha256'])[:12]}..., eos {mine['eos_id']}, bos {mine['bos_id']}) than "
                             f"{field} (sha256 {str(theirs['sha256'])[:12]}..., eos {theirs['eos_id']}, bos "
                             f"{theirs['bos_id']}); prepare them again with this tokenizer")
