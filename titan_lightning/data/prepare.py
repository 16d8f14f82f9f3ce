"""``titan-lightning prepare``: JSONL, Parquet and text files into token shards (data/shards.py).

    titan-lightning prepare --input corpus/ --input extra.jsonl --output shards/
        [--tokenizer PATH] [--text-field text] [--workers N] [--bad-records skip|stop]

Inputs are files, folders (every .jsonl, .json, .txt and .parquet below them) or globs, taken in
sorted order; a JSONL, JSON or text file may come compressed (``.jsonl.gz``, ``.json.bz2``,
``.txt.xz``, ``.jsonl.zst``: gzip, bzip2, xz, Zstandard with ``pip install titan-lightning[zstd]``),
and is then decompressed once, before the work, into a temporary folder beside the output (removed
at the end; messages name the compressed file and the line in it).
A JSONL line is one document (its ``--text-field``), as is each element of a ``.json``
file that holds one JSON array (read whole, one part); a Parquet row is one document
(that column; needs pyarrow: ``pip install titan-lightning[parquet]``); a text file holds
documents separated by ``<|endoftext|>`` (one document if it has none). Each document becomes its
token ids, then the tokenizer's EOS (after its BOS, when its tokenizer_config.json or its
post-processor adds one).

The corpus is cut into parts (JSONL: byte ranges of about 64 MiB ending at a line end; Parquet:
row groups; text: files), each written as shards named after it. With several workers a part is
also cut into pieces (JSONL: at line ends; Parquet: row ranges; text: at ``<|endoftext|>``) of
about a quarter of a worker's share of the corpus, so that one large file keeps every worker
busy; a part's pieces, tokenized into files of their own, are then copied into its shards in
order. The output does not depend on the number of workers. Finished parts are recorded in
``progress.json``: an interrupted prepare run again with the same arguments resumes with the
parts not yet done. ``index.json`` is written last. The progress shows the bytes read of the
total, tokens/s and an ETA (a bar on a terminal, a line every 10 s in a log).

A bad record (a JSONL line that is not JSON, or has no text in the field): ``--bad-records
skip`` counts it (the summary names the first), ``stop`` ends the run on it, naming file and line.

Chat and instruction data (``--chat``: a ``messages`` list per record; ``--prompt-field`` and
``--response-field``: prompt/response pairs) are rendered with the tokenizer's chat template and
written with a loss mask per token (data/chat.py), a record's ``tools`` passed to the template; a
conversation with no assistant turn, an unknown role, a content that is not a string (but for an
assistant turn that only calls tools), tools that are not a list of objects, or on which the
template fails is a bad record.

Preference pairs (``--preference``: a prompt and a chosen and a rejected answer; data/preference.py)
are two such conversations each, written one after the other, kept or dropped together.
"""

import dataclasses
import glob
import importlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from titan_lightning.data.chat import (TOO_LONG, TRAIN_ON, BadRecord, ChatOptions, ChatRenderer, ChatSpec,
                                      TemplateFailure, resolve)
from titan_lightning.data.preference import PreferenceOptions, PreferenceRenderer, renderer_for
from titan_lightning.data.text import EOT
from titan_lightning.data.shards import INDEX, ShardWriter, token_dtype, tokenizer_identity, write_index
from titan_lightning.data.tokenizer import load_tokenizer, tokenizer_file

KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "text", ".parquet": "parquet"}
# Compressed inputs, by the last suffix (train.jsonl.gz): the module whose open() reads them (the
# standard library's, and zstandard's, an optional extra: `pip install titan-lightning[zstd]`).
COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma", ".zst": "zstandard"}
PART_BYTES = 64 * 2**20
MIN_PIECE_BYTES = 256 * 2**10  # the smallest piece a part is cut into for several workers
PROGRESS = "progress.json"
BATCH = 256  # documents per tokenizer call
Field = tuple[str, str, type]  # a record field read: its name, the option that names it, its value's type


class PrepareError(ValueError):
    """Bad input to prepare: one line, exit status 2."""


@dataclass(frozen=True)
class Part:
    """One unit of output: a byte range of a JSONL file, a row group of a Parquet file, a text file;
    or a piece of one (a shorter byte range; some of the row group's rows)."""

    path: str
    kind: str
    start: int  # byte offset (jsonl, text), row group (parquet)
    stop: int
    size: int = 0  # the input bytes it stands for (the progress counts them; Parquet: its rows' share)
    rows: Optional[tuple[int, int]] = None  # parquet: the rows of the row group it reads (None: all)


def file_kind(path: Path) -> str:
    """How ``path`` is read: ``jsonl``, ``text``, ``parquet``, or ``json`` for a ``.json`` file that
    holds one JSON array of records (Alpaca's alpaca_data.json, ShareGPT dumps) rather than lines."""
    kind = KINDS[path.suffix]
    if path.suffix == ".json":
        with path.open("rb") as f:
            head = f.read(1 << 12).lstrip()
        kind = "json" if head.startswith(b"[") else kind
    return kind


def first_element(path: Path) -> tuple[bool, Any]:
    """(whether the JSON array in ``path`` has an element, its first), from as much of the file as
    the element takes; PrepareError when the file does not begin with one."""
    decoder, head = json.JSONDecoder(), b""
    with path.open("rb") as f:
        while True:
            chunk = f.read(max(len(head), 1 << 16))
            head += chunk
            text = head.decode("utf-8", errors="ignore")  # (a character cut at the end: read on)
            at = text.index("[") + 1
            while at < len(text) and text[at].isspace():
                at += 1
            if text.startswith("]", at):
                return False, None
            try:
                return True, decoder.raw_decode(text, at)[0]
            except ValueError as err:
                if not chunk:
                    raise PrepareError(f"{path}: a JSON array whose first element is not JSON ({err})") from None


def find_inputs(inputs: list[str]) -> list[Path]:
    """The files named by ``inputs`` (files, folders, globs), sorted, each checked to be one we read."""
    files: list[Path] = []
    for spec in inputs:
        matches = sorted(glob.glob(spec, recursive=True)) if glob.has_magic(spec) else [spec]
        if not matches or not Path(matches[0]).exists():
            raise PrepareError(f"--input {spec!r}: no such file or folder")
        for match in map(Path, matches):
            if match.is_dir():
                found = sorted(p for p in match.rglob("*") if p.is_file() and _readable_suffix(p))
                if not found:
                    raise PrepareError(f"--input {spec!r}: the folder holds no {', '.join(KINDS)} file")
                files.extend(found)
            elif not _readable_suffix(match):
                inner = (f"{_inner_suffix(match) or 'no'} extension inside {match.suffix}"
                         if match.suffix in COMPRESSED else f"{match.suffix or 'no'} extension")
                raise PrepareError(f"--input {str(match)!r}: {inner}; prepare reads {', '.join(KINDS)} files "
                                   f"(JSONL, JSON and text also as {', '.join(COMPRESSED)})")
            else:
                files.append(match)
    return sorted(dict.fromkeys(files))


def _inner_suffix(path: Path) -> str:
    """The suffix of a compressed file's contents (train.jsonl.gz: .jsonl)."""
    return Path(path.stem).suffix


def _readable_suffix(path: Path) -> bool:
    if path.suffix in COMPRESSED:
        return _inner_suffix(path) in KINDS and _inner_suffix(path) != ".parquet"  # (Parquet compresses itself)
    return path.suffix in KINDS


def _decompress(files: list[Path], folder: Path, progress: bool) -> dict[Path, Path]:
    """Each compressed file of ``files`` decompressed into ``folder`` (named as its contents:
    train.jsonl.gz -> train.jsonl, in a subfolder of its own); {decompressed: compressed}."""
    copies = {}
    for i, path in enumerate(files):
        if path.suffix not in COMPRESSED:
            continue
        target = folder / str(i) / path.stem
        target.parent.mkdir()
        if progress:
            print(f"prepare: decompressing {path}", file=sys.stderr, flush=True)
        codec = _codec(path)
        try:
            with codec.open(path, "rb") as source, target.open("wb") as out:
                shutil.copyfileobj(source, out, 1 << 22)
        except (OSError, EOFError, ValueError, getattr(codec, "ZstdError", OSError)) as err:  # corrupt, cut short
            raise PrepareError(f"{path}: cannot decompress ({COMPRESSED[path.suffix]}: "
                               f"{' '.join(str(err).split())[:200]})") from None
        copies[target] = path
    return copies


def _codec(path: Path):
    """The module that reads the compressed ``path``; PrepareError naming the extra where it is missing."""
    try:
        return importlib.import_module(COMPRESSED[path.suffix])
    except ImportError:
        raise PrepareError(f"{path}: {path.suffix} input needs {COMPRESSED[path.suffix]}; "
                           f"pip install 'titan-lightning[zstd]'") from None


def _named_as_given(message: str, copies: dict[Path, Path]) -> str:
    """``message`` with each decompressed copy's path replaced by its compressed file's."""
    for copy, path in copies.items():
        message = message.replace(str(copy), f"{path} (decompressed)")
    return message


def _temporary_folder_near(output: Path) -> Path:
    """The nearest existing folder at or above ``output`` (its file system holds the shards too)."""
    folder = output.absolute()
    while not folder.is_dir():
        folder = folder.parent
    return folder


def check_input(path: Path, fields: list[Field]) -> None:
    """Before any work: the file is non-empty text (or Parquet with the columns), its first JSONL
    record has each of ``fields``."""
    if path.stat().st_size == 0:
        raise PrepareError(f"{path}: empty file")
    kind = file_kind(path)
    if kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PrepareError(f"{path}: Parquet needs pyarrow; pip install 'titan-lightning[parquet]'") from None
        try:
            schema = pq.ParquetFile(path).schema_arrow
        except Exception as err:  # noqa: BLE001 - pyarrow raises its own error types for bad files
            raise PrepareError(f"{path}: not a Parquet file ({' '.join(str(err).split())[:200]})") from None
        for name, option, _ in fields:
            if name not in schema.names:
                raise PrepareError(f"{path}: no column {name!r} ({option}); columns: {', '.join(schema.names)}"
                                   f"{_format_hint(option, schema.names)}")
        return
    head = path.open("rb").read(1 << 16)
    if b"\x00" in head:
        raise PrepareError(f"{path}: binary (a NUL byte at {head.index(0)}); prepare reads UTF-8 text")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 4:  # not just a character cut at the end of the sample
            raise PrepareError(f"{path}: not UTF-8 (byte {err.start}: {err.reason})") from None
    if kind in ("jsonl", "json"):
        if kind == "json":
            where = f"{path}: element 0"
            has, record = first_element(path)
            if not has:
                raise PrepareError(f"{path}: an empty JSON array")
        else:
            where, first = f"{path}:1", next((line for line in head.splitlines() if line.strip()), b"")
            try:
                record = json.loads(first)
            except ValueError:
                raise PrepareError(f"{path}:1: not a JSON line") from None
        for name, option, kind_of in fields:
            if not isinstance(record, dict) or not isinstance(record.get(name), kind_of):
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                what = {str: "text", list: "list"}.get(kind_of, "text or list")
                if isinstance(record, dict) and record.get(name) is not None:
                    raise PrepareError(f"{where}: field {name!r} ({option}) is a {type(record[name]).__name__}, "
                                       f"not {'a ' if what == 'list' else ''}{what}")
                raise PrepareError(f"{where}: no {what} field {name!r} ({option}); the record has: {keys}"
                                   f"{_format_hint(option, record if isinstance(record, dict) else ())}")
    elif kind == "text" and fields[0][1] != "--text-field":
        raise PrepareError(f"{path}: a text file holds documents, not conversations; give JSONL or Parquet "
                           f"records for {fields[0][1]}")


def _format_hint(option: str, fields) -> str:
    """The flags that read records with ``fields`` (their keys, or a Parquet file's columns) in the
    layout they look like, when ``option`` names a field they lack: TRL's and the common formats."""
    fields = set(fields)
    for wanted, name, flags in [({"chosen", "rejected"}, "preference pairs", "--preference"),
                                ({"messages"}, "conversations", "--chat"),
                                ({"conversations"}, "ShareGPT data", "--chat --messages-field conversations"),
                                ({"prompt", "completion"}, "prompt-completion data",
                                 "--prompt-field prompt --response-field completion"),
                                ({"instruction", "input", "output"}, "Alpaca data",
                                 "--prompt-field instruction,input --response-field output"),
                                ({"instruction", "output"}, "instruction data",
                                 "--prompt-field instruction --response-field output")]:
        if option == "--messages-field":  # --chat is given
            flags = flags.removeprefix("--chat").strip()
        if wanted <= fields and flags:
            return f"; {name}: {flags}"
    return ""


def plan_parts(files: list[Path]) -> list[Part]:
    parts = []
    for path in files:
        kind = file_kind(path)
        if kind == "parquet":
            import pyarrow.parquet as pq

            metadata = pq.ParquetFile(path).metadata
            rows, size = max(metadata.num_rows, 1), path.stat().st_size
            parts.extend(Part(str(path), kind, g, g + 1, size * metadata.row_group(g).num_rows // rows)
                         for g in range(metadata.num_row_groups))
        elif kind in ("text", "json"):  # (a JSON array is read whole, by one worker)
            parts.append(Part(str(path), kind, 0, path.stat().st_size, path.stat().st_size))
        else:
            size, start = path.stat().st_size, 0
            with path.open("rb") as f:
                while start < size:
                    f.seek(min(start + PART_BYTES, size))
                    f.readline()
                    stop = min(f.tell(), size)
                    parts.append(Part(str(path), kind, start, stop, stop - start))
                    start = stop
    return parts


def split_part(part: Part, pieces: int) -> list[Part]:
    """``part`` cut into at most ``pieces`` pieces that read, one after the other, its records: JSONL
    at line ends, text at a ``<|endoftext|>``, Parquet by rows."""
    if pieces <= 1 or part.kind == "json":
        return [part]
    if part.kind == "parquet":
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(part.path).metadata.row_group(part.start).num_rows
        cuts = sorted({rows * k // pieces for k in range(pieces + 1)})
        return [dataclasses.replace(part, size=_share(part.size, b, rows) - _share(part.size, a, rows), rows=(a, b))
                for a, b in zip(cuts, cuts[1:])]
    cuts = [part.start]
    with open(part.path, "rb") as f:
        for k in range(1, pieces):
            at = _boundary(f, part.start + (part.stop - part.start) * k // pieces, part.stop, part.kind)
            if cuts[-1] < at < part.stop:
                cuts.append(at)
    cuts.append(part.stop)
    return [dataclasses.replace(part, start=a, stop=b, size=b - a) for a, b in zip(cuts, cuts[1:])]


def _share(size: int, row: int, rows: int) -> int:
    """The bytes of ``size`` that its first ``row`` of ``rows`` rows stand for (shares that add up)."""
    return size * row // max(rows, 1)


def _boundary(f, offset: int, stop: int, kind: str) -> int:
    """The first place at or after byte ``offset`` where a piece may start: after a line end
    (JSONL), at an ``<|endoftext|>`` (text); ``stop`` if there is none before it."""
    f.seek(offset)
    if kind == "jsonl":
        f.readline()
        return min(f.tell(), stop)
    needle, window = EOT.encode(), 1 << 16
    while offset < stop:
        chunk = f.read(min(window + len(needle), stop - offset))
        found = chunk.find(needle)
        if found >= 0:
            return offset + found
        if len(chunk) <= len(needle):
            break
        offset += len(chunk) - len(needle) + 1
        f.seek(offset)
    return stop


def _documents(part: Part, text_field: str, bad_records: str, bad: list) -> Iterator[str]:
    if part.kind == "text":
        with open(part.path, "rb") as f:
            f.seek(part.start)
            text = f.read(part.stop - part.start).decode("utf-8", errors="strict")
        for doc in text.split(EOT):
            _progress(len(doc) + len(EOT))
            if doc.strip():
                yield doc.strip()
        return
    for where, record in _records(part, [text_field], bad_records, bad):
        text = record.get(text_field) if isinstance(record, dict) else None
        if isinstance(text, str) and text.strip():
            yield text
        else:
            _bad(bad, bad_records, f"{where}: no text in {text_field!r}")


def _columns(parquet, fields: list[str], optional: Sequence[str]) -> list[str]:
    """The columns of the ``pq.ParquetFile`` to read: ``fields``, and those of ``optional`` it has."""
    names = parquet.schema_arrow.names
    return [*fields, *(name for name in optional if name in names and name not in fields)]


def _records(part: Part, fields: list[str], bad_records: str, bad: list,
             optional: Sequence[str] = ()) -> Iterator[tuple[Any, Any]]:
    """(where, record) for each record of a JSONL or Parquet part: ``file:line`` and the parsed
    line, or ``file: row group g row r`` and the row's ``fields`` (and the ``optional`` ones the
    file has)."""
    if part.kind == "parquet":
        import pyarrow.parquet as pq

        file = pq.ParquetFile(part.path)
        table = file.read_row_group(part.start, columns=_columns(file, fields, optional))
        first, last = part.rows or (0, table.num_rows)
        for row, record in enumerate(table.slice(first, last - first).to_pylist(), first):
            _progress(_share(part.size, row + 1 - first, last - first) - _share(part.size, row - first, last - first))
            yield f"{part.path}: row group {part.start} row {row}", record
        return
    if part.kind == "json":
        try:
            records = json.loads(Path(part.path).read_bytes())
        except ValueError as err:
            raise PrepareError(f"{part.path}: not a JSON array ({err})") from None
        for k, record in enumerate(records):
            _progress(_share(part.size, k + 1, len(records)) - _share(part.size, k, len(records)))
            yield f"{part.path}: element {k}", record
        return
    with open(part.path, "rb") as f:
        f.seek(part.start)
        line = 0
        while f.tell() < part.stop:
            raw = f.readline()
            line += 1
            _progress(len(raw))
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                _bad(bad, bad_records, f"{_Line(part.path, part.start, line)}: not a JSON line")
                continue
            yield _Line(part.path, part.start, line), record


class _Line:
    """``file:line`` of a part's ``line``-th line, the lines before the part counted once, when a
    message first needs them."""

    def __init__(self, path: str, start: int, line: int) -> None:
        self.path, self.start, self.line = path, start, line

    def __str__(self) -> str:
        return f"{self.path}:{_lines_before(self.path, self.start, os.stat(self.path).st_mtime_ns) + self.line}"


@lru_cache(maxsize=64)
def _lines_before(path: str, offset: int, mtime_ns: int) -> int:
    """Lines before byte ``offset`` of the file (as it was at ``mtime_ns``)."""
    count, read = 0, 0
    with open(path, "rb") as f:
        while read < offset:
            chunk = f.read(min(1 << 20, offset - read))
            count += chunk.count(b"\n")
            read += len(chunk)
    return count


def _bad(bad: list, policy: str, message: str) -> None:
    if policy == "stop":
        raise PrepareError(f"{message} (--bad-records stop)")
    bad.append(message)


_WORKER: dict[str, Any] = {}


def _load_worker(tokenizer_path: Optional[str], counter=None) -> None:
    """A worker's state: its tokenizer, and its meter of the shared progress ``counter``."""
    _WORKER["tokenizer"] = load_tokenizer(tokenizer_path)
    _WORKER["meter"] = _Meter(counter)


class _Meter:
    """A worker's input bytes read and tokens written, added to the run's shared counter (a
    ``multiprocessing.Array`` of two: bytes, tokens) at most every 0.2 s and at the end of a piece.
    A piece counts its ``size`` bytes in all, whatever its records' own lengths add up to."""

    def __init__(self, counter=None) -> None:
        self.counter, self.pending, self.flushed, self.left = counter, [0, 0], 0.0, 0

    def start(self, size: int) -> None:
        self.left = size

    def add(self, nbytes: int = 0, tokens: int = 0) -> None:
        nbytes = min(nbytes, self.left)
        self.left -= nbytes
        self.pending[0] += nbytes
        self.pending[1] += tokens
        if time.monotonic() - self.flushed >= 0.2:
            self.flush()

    def flush(self) -> None:
        if self.counter is not None and any(self.pending):
            with self.counter.get_lock():
                self.counter[0] += self.pending[0]
                self.counter[1] += self.pending[1]
        self.pending, self.flushed = [0, 0], time.monotonic()

    def finish(self) -> None:
        self.add(self.left)
        self.flush()


def _progress(nbytes: int) -> None:
    meter = _WORKER.get("meter")
    if meter is not None:
        meter.add(nbytes)


def _run_part(job: tuple) -> dict[str, Any]:
    """Tokenize one part, or one piece of it, into shards (in a worker process); what it wrote and
    skipped. A piece's documents go to one file set of its own, ``piece-PPPPP-KKKKK-00000``."""
    index, piece, pieces, part, output, text_field, bad_records, shard_tokens, chat = job
    tokenizer, meter = _WORKER["tokenizer"], _WORKER["meter"]
    name, per_shard = (f"part-{index:05d}", shard_tokens) if pieces == 1 else (f"piece-{index:05d}-{piece:05d}", 2**62)
    writer = ShardWriter(Path(output), name, token_dtype(tokenizer.vocab_size), per_shard)

    def write(ids: np.ndarray, mask: Optional[np.ndarray] = None) -> None:
        writer.add(ids, mask)
        meter.add(tokens=len(ids))

    bad: list[str] = []
    counts = {"kept": 0, "truncated": 0, "dropped": 0}
    meter.start(part.size)
    try:
        if chat is None:
            for batch in _batches(_documents(part, text_field, bad_records, bad)):
                for ids in tokenizer.encode_documents(batch):
                    write(ids)
        else:
            _write_conversations(part, chat, bad_records, bad, write, counts)
    except PrepareError as err:
        return {"index": index, "error": str(err)}
    meter.finish()
    shards = writer.close()
    result = {"index": index, "piece": piece, "pieces": pieces, "shards": shards, "bad": len(bad),
              "first_bad": bad[0] if bad else None, "tokens": sum(s["tokens"] for s in shards), "bytes": part.size}
    if chat is not None:
        result.update(truncated=counts["truncated"], dropped=counts["dropped"],
                      supervised=sum(s["supervised"] for s in shards))
    return result


def _assemble(out: Path, index: int, pieces: list[dict], dtype: np.dtype, shard_tokens: int) -> dict[str, Any]:
    """Part ``index`` from its pieces' files (removed after): their documents, in order, through one
    ShardWriter, as one worker tokenizing the whole part writes them; the pieces' counts added up."""
    writer = ShardWriter(out, f"part-{index:05d}", dtype, shard_tokens)
    for piece in pieces:
        for shard in piece["shards"]:
            files = {ext: out / f"{shard['name']}.{ext}" for ext in ("tokens", "docs", "mask")}
            tokens, ends = np.fromfile(files["tokens"], dtype), np.fromfile(files["docs"], "<i8").tolist()
            mask = np.fromfile(files["mask"], np.uint8) if files["mask"].is_file() else None
            for a, b in zip([0, *ends[:-1]], ends):
                writer.add(tokens[a:b], None if mask is None else mask[a:b])
            for file in files.values():
                file.unlink(missing_ok=True)
    shards = writer.close()
    result = {"index": index, "shards": shards, "bad": sum(p["bad"] for p in pieces),
              "first_bad": next((p["first_bad"] for p in pieces if p["first_bad"]), None),
              "tokens": sum(s["tokens"] for s in shards), "bytes": sum(p["bytes"] for p in pieces)}
    if "supervised" in pieces[0]:
        result.update(truncated=sum(p["truncated"] for p in pieces), dropped=sum(p["dropped"] for p in pieces),
                      supervised=sum(s["supervised"] for s in shards))
    return result


def _write_conversations(part: Part, chat: ChatSpec, bad_records: str, bad: list, write,
                         counts: dict[str, int]) -> None:
    """Each record of ``part`` as a conversation (with ``--preference``, a pair of them: chosen, then
    rejected): rendered, tokenized with its mask, fitted to ``max_tokens``, given to ``write(ids,
    mask)`` (``counts``: how many records were kept, truncated, dropped; a pair as one)."""
    if _WORKER.get("chat") is not chat:
        _WORKER["chat"], _WORKER["renderer"] = chat, renderer_for(chat, _WORKER["tokenizer"])
    renderer: ChatRenderer = _WORKER["renderer"]

    def rendered() -> Iterator[list[tuple[str, list]]]:
        for where, record in _records(part, chat.options.fields, bad_records, bad, chat.options.optional_fields):
            try:
                if isinstance(renderer, PreferenceRenderer):
                    yield renderer.render_pair(record)
                else:
                    messages, skip = renderer.conversation(record)
                    yield [renderer.render(messages, renderer.tools(record), skip=skip)]
            except BadRecord as err:
                _bad(bad, bad_records, f"{where}: {err}")

    for batch in _batches(rendered()):
        encoded = iter(renderer.encode([conversation for group in batch for conversation in group]))
        for group in batch:
            fitted = [renderer.fit(*next(encoded)) for _ in group]
            outcomes = {outcome for _, outcome in fitted}
            outcome = next(o for o in ("dropped", "truncated", "kept") if o in outcomes)
            counts[outcome] += 1
            if outcome != "dropped":  # a pair is written whole or not at all
                for conversation, _ in fitted:
                    write(*conversation)


def _batches(items: Iterator) -> Iterator[list]:
    """``items`` in lists of ``BATCH`` (a tokenizer call each), or fewer when a second has passed
    (so that the progress counts tokens as they are written)."""
    batch, since = [], time.monotonic()
    for item in items:
        batch.append(item)
        if len(batch) == BATCH or time.monotonic() - since >= 1.0:
            yield batch
            batch, since = [], time.monotonic()
    if batch:
        yield batch


def prepare(inputs: list[str], output: str, *, tokenizer_path: Optional[str] = None, text_field: str = "text",
            workers: Optional[int] = None, bad_records: str = "skip", shard_tokens: int = 2**28,
            progress: bool = True, chat: Optional[ChatOptions] = None) -> dict[str, Any]:
    """Tokenize ``inputs`` into the shard set ``output``; a summary dict. PrepareError on bad input
    (before any work), or on a bad record under ``bad_records="stop"``. ``chat``: the records are
    conversations, written with a loss mask (data/chat.py). Compressed inputs are read from
    decompressed copies in a temporary folder beside ``output``."""
    if bad_records not in ("skip", "stop"):
        raise PrepareError(f"--bad-records={bad_records!r}: expected skip or stop")
    if workers is not None and workers < 1:
        raise PrepareError(f"--workers={workers}: expected >= 1")
    files = find_inputs(inputs)
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--output {output!r} is a file; give a folder for the shards (a new or an empty one)")
    if (out / INDEX).is_file():
        raise PrepareError(f"--output {output!r} already holds a shard set ({INDEX}); choose another folder")
    options = dict(tokenizer_path=tokenizer_path, text_field=text_field, workers=workers, bad_records=bad_records,
                   shard_tokens=shard_tokens, progress=progress, chat=chat)
    if not any(path.suffix in COMPRESSED for path in files):
        return _prepare(files, output, {}, **options)
    for path in files:  # (a codec missing: before any file is decompressed)
        if path.suffix in COMPRESSED:
            _codec(path)
    with tempfile.TemporaryDirectory(prefix=".prepare-decompressed-", dir=_temporary_folder_near(out)) as tmp:
        copies: dict[Path, Path] = {}
        try:
            copies = _decompress(files, Path(tmp), progress)
            plain = {path: copy for copy, path in copies.items()}
            summary = _prepare([plain.get(path, path) for path in files], output, copies, **options)
        except PrepareError as err:
            raise PrepareError(_named_as_given(str(err), copies)) from None
    if summary["first_bad"]:
        summary["first_bad"] = _named_as_given(summary["first_bad"], copies)
    return summary


def _prepare(files: list[Path], output: str, copies: dict[Path, Path], *, tokenizer_path: Optional[str],
             text_field: str, workers: Optional[int], bad_records: str, shard_tokens: int, progress: bool,
             chat: Optional[ChatOptions]) -> dict[str, Any]:
    """prepare of ``files``; ``copies``: {decompressed copy: the compressed input it stands for}
    (recorded as the inputs, so that a resume matches them)."""
    for path in files:
        check_input(path, chat.field_options if chat else [(text_field, "--text-field", str)])
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except (OSError, ValueError) as err:
        raise PrepareError(str(err).replace("data.tokenizer_path", "--tokenizer")) from None
    spec = None
    if chat is not None:
        try:
            spec = resolve(chat, tokenizer_path)
        except ValueError as err:
            raise PrepareError(str(err)) from None
        _check_tools_field(files, chat)
        for path in files:
            _check_first_record(path, spec, tokenizer)
    out = Path(output)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PrepareError(f"--output {output!r}: cannot create the folder ({err.strerror})") from None
    identity = tokenizer_identity(tokenizer_file(tokenizer_path), tokenizer.vocab_size, tokenizer.eot_id,
                                  tokenizer.bos_id if tokenizer.add_bos else None)
    parts = plan_parts(files)
    given = [copies.get(p, p) for p in files]
    settings = {"inputs": [str(p.resolve()) for p in given], "sizes": [p.stat().st_size for p in given],
                "text_field": text_field, "tokenizer": identity, "shard_tokens": shard_tokens}
    if spec is not None:
        spec = _clock_of_interrupted_run(out, spec)
        settings["chat"] = spec.settings()
    resumed = (out / PROGRESS).is_file()
    try:
        done = _resume(out, settings)
    except PrepareError:
        if created:
            shutil.rmtree(out)
        raise
    dtype = token_dtype(tokenizer.vocab_size)
    workers = workers or os.cpu_count() or 1
    todo = [part for i, part in enumerate(parts) if i not in done]
    # Several workers: pieces of about a quarter of a worker's share, so that one large file is
    # shared by all of them and the last pieces finish together.
    piece_bytes = max(MIN_PIECE_BYTES, sum(p.size for p in todo) // (4 * workers))
    jobs = []
    for i, part in enumerate(parts):
        if i not in done:
            pieces = split_part(part, 1 if workers == 1 else -(-part.size // piece_bytes))
            jobs.extend((i, k, len(pieces), piece, str(out), text_field, bad_records, shard_tokens, spec)
                        for k, piece in enumerate(pieces))
    _save_progress(out, settings, done)  # resumable from here on, even before a part is finished
    counter = _counter()
    bar = _Progress(sum(p.size for p in parts), sum(r["bytes"] for r in done.values()), counter, progress)
    results = _map(_run_part, jobs, tokenizer_path, min(workers, len(jobs)), counter)
    waiting: dict[int, dict[int, dict]] = {}  # the pieces done of parts not yet assembled
    try:
        for result in results:
            if "error" in result:
                raise PrepareError(result["error"])
            index, piece, pieces = result.pop("index"), result.pop("piece"), result.pop("pieces")
            if pieces > 1:
                waiting.setdefault(index, {})[piece] = result
                if len(waiting[index]) < pieces:
                    continue
                finished = waiting.pop(index)
                result = _assemble(out, index, [finished[k] for k in range(pieces)], dtype, shard_tokens)
                result.pop("index")
            done[index] = result
            _save_progress(out, settings, done)
        _check_every_file_has_documents(files, parts, done, text_field, chat)
    except BaseException as err:
        results.close()  # the workers are stopped before their files are removed
        bar.close(clear=True)
        if isinstance(err, PrepareError):
            # Bad input: the error alone on the terminal, and nothing of this run left behind (a
            # folder an earlier interrupted run left keeps what that run finished).
            _undo(out, created, done if resumed else None)
        else:  # interrupted: what is finished stays recorded, for a resume
            _remove_unrecorded(out, done)
        raise
    bar.close()
    shards = [shard for i in sorted(done) for shard in done[i]["shards"]]
    sft = None
    if spec is not None:
        sft = {"train_on": chat.train_on, "max_tokens": chat.max_tokens, "too_long": chat.too_long,
               "conversations": sum(s["documents"] for s in shards),
               "truncated": sum(r["truncated"] for r in done.values()),
               "dropped": sum(r["dropped"] for r in done.values()),
               "chat_template_sha256": spec.template_sha256,
               "supervised_tokens": sum(s["supervised"] for s in shards)}
        if isinstance(chat, PreferenceOptions):  # documents 2k and 2k + 1: pair k's chosen and rejected answers
            sft["pairs"] = sft["conversations"] // 2
    write_index(out, dtype, identity, shards, settings["inputs"], sft=sft)
    (out / PROGRESS).unlink(missing_ok=True)
    bad = [done[i] for i in sorted(done) if done[i]["bad"]]
    return {"tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
            "shards": len(shards), "bad_records": sum(r["bad"] for r in bad),
            "first_bad": bad[0]["first_bad"] if bad else None, **({"sft": sft} if sft else {})}


def _check_tools_field(files: list[Path], chat: ChatOptions) -> None:
    """A ``--tools-field`` given by name (not the default ``tools``) that no record has: most likely
    misspelled, an error before any work (a JSONL file without the quoted name anywhere has no
    record with it; a Parquet file, no such column)."""
    name = chat.tools_field
    if chat.messages_field is None or name in (None, ChatOptions.tools_field):
        return
    import mmap

    for path in files:
        if file_kind(path) == "parquet":
            import pyarrow.parquet as pq

            if name in pq.ParquetFile(path).schema_arrow.names:
                return
        elif file_kind(path) in ("jsonl", "json"):
            with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                if data.find(json.dumps(name).encode()) >= 0:
                    return
    raise PrepareError(f"--tools-field {name!r}: no record has this field; the records have: "
                       f"{', '.join(_record_fields(files[0]))}")


def _record_fields(path: Path) -> list[str]:
    """The fields of the first record of a JSONL file or JSON array, the columns of a Parquet file."""
    if file_kind(path) == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).schema_arrow.names
    if file_kind(path) == "json":
        record = first_element(path)[1]
        return list(record) if isinstance(record, dict) else []
    with path.open("rb") as f:
        record = json.loads(next(line for line in f if line.strip()))
    return list(record) if isinstance(record, dict) else []


def _check_first_record(path: Path, spec: ChatSpec, tokenizer) -> None:
    """Before any work: the chat template renders the first record of ``path`` (a record that is
    bad in itself is left to ``--bad-records``)."""
    if file_kind(path) == "json":
        where, record = f"{path}: element 0", first_element(path)[1]
    elif file_kind(path) == "parquet":
        import pyarrow.parquet as pq

        file = pq.ParquetFile(path)
        columns = _columns(file, spec.options.fields, spec.options.optional_fields)
        batch = next(file.iter_batches(batch_size=1, columns=columns), None)
        if batch is None or not batch.num_rows:
            return
        where, record = f"{path}: row group 0 row 0", batch.to_pylist()[0]
    else:
        with path.open("rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    break
        where, record = f"{path}:{number}", json.loads(line)
    renderer = renderer_for(spec, tokenizer)
    try:
        (messages, skip), tools = renderer.conversation(record), renderer.tools(record)
    except BadRecord:
        return
    try:
        renderer.render(messages, tools, skip=skip)
    except TemplateFailure as err:
        raise PrepareError(f"{where}: {err}") from None
    except BadRecord:
        return


def _clock_of_interrupted_run(out: Path, spec: ChatSpec) -> ChatSpec:
    """``spec`` with the time an interrupted run rendered (``strftime_now`` in a template), so that
    its resume writes the same date into the parts it has left."""
    try:
        now = json.loads((out / PROGRESS).read_text())["settings"]["chat"]["now"]
    except (OSError, ValueError, KeyError, TypeError):
        return spec
    return dataclasses.replace(spec, now=now)


def _resume(out: Path, settings: dict) -> dict[int, dict]:
    """The parts an earlier run with the same settings finished; the files of unfinished ones removed."""
    file = out / PROGRESS
    done: dict[int, dict] = {}
    if file.is_file():
        saved = json.loads(file.read_text())
        if saved.get("settings") != settings:
            raise PrepareError(f"--output {str(out)!r} holds an unfinished prepare of other inputs or settings; "
                               f"remove it or choose another folder")
        done = {int(k): v for k, v in saved["done"].items()}
    elif any(out.iterdir()):
        raise PrepareError(f"--output {str(out)!r} is not empty and holds no unfinished prepare; choose another folder")
    _remove_unrecorded(out, done)
    return done


def _undo(out: Path, created: bool, resumed: Optional[dict[int, dict]]) -> None:
    """Leave ``out`` as this run found it: removed if it created it; else without this run's files,
    or, when it resumed an interrupted run, with the parts finished (``resumed``) still recorded."""
    if created:
        shutil.rmtree(out)
    elif resumed is not None:
        _remove_unrecorded(out, resumed)
    else:
        _remove_unrecorded(out, {})
        for name in (PROGRESS, PROGRESS + ".partial"):
            (out / name).unlink(missing_ok=True)


def _remove_unrecorded(out: Path, done: dict[int, dict]) -> None:
    """Remove the shard files of parts that ``done`` does not record (an unfinished part's), and
    every piece's."""
    kept = {f"{s['name']}.{ext}" for r in done.values() for s in r["shards"] for ext in ("tokens", "docs", "mask")}
    for path in [*out.glob("part-*"), *out.glob("piece-*")]:
        if path.name not in kept:
            path.unlink()


def _check_every_file_has_documents(files: list[Path], parts: list[Part], done: dict[int, dict],
                                    text_field: str, chat: Optional[ChatOptions] = None) -> None:
    """A file of which no record gave a document (a Parquet column of nulls, ...) is an error, not
    an empty contribution: the field or column is most likely the wrong one."""
    documents = {str(path): 0 for path in files}
    bad = dict.fromkeys(documents, 0)
    dropped = dict.fromkeys(documents, 0)
    first_bad: dict[str, Optional[str]] = {}
    for i, result in sorted(done.items()):
        documents[parts[i].path] += sum(s["documents"] for s in result["shards"])
        bad[parts[i].path] += result["bad"]
        dropped[parts[i].path] += result.get("dropped", 0)
        if result["first_bad"] is not None:
            first_bad.setdefault(parts[i].path, result["first_bad"])
    for path in files:
        if documents[str(path)]:
            continue
        if chat is not None and dropped[str(path)] and chat.too_long == "truncate":
            raise PrepareError(f"{path}: all its {dropped[str(path)]} conversations that are not bad records have no "
                               f"supervised token in their first --max-tokens {chat.max_tokens} (--too-long truncate "
                               f"drops a conversation left with nothing to train on); raise --max-tokens")
        if chat is not None and dropped[str(path)]:
            raise PrepareError(f"{path}: all its {dropped[str(path)]} conversations that are not bad records are "
                               f"longer than --max-tokens {chat.max_tokens} (--too-long drop); raise --max-tokens "
                               f"or use --too-long truncate")
        if chat is not None:
            options = ("--prompt-field, --chosen-field and --rejected-field" if isinstance(chat, PreferenceOptions)
                       else "--messages-field" if chat.messages_field else "--prompt-field and --response-field")
            raise PrepareError(f"{path}: none of its {bad[str(path)]} records is a conversation to train on (the "
                               f"first: {first_bad.get(str(path))}); check the records, or name the fields with "
                               f"{options}")
        if file_kind(path) == "parquet":
            import pyarrow.parquet as pq

            columns = ", ".join(pq.ParquetFile(path).schema_arrow.names)
            raise PrepareError(f"{path}: the column {text_field!r} is null or empty in all {bad[str(path)]} rows; "
                               f"name the column that holds the text with --text-field (columns: {columns})")
        if file_kind(path) in ("jsonl", "json"):
            raise PrepareError(f"{path}: none of its {bad[str(path)]} records has text in the field {text_field!r} "
                               f"(the first: {first_bad[str(path)]}); name the field with --text-field")
        raise PrepareError(f"{path}: holds no document, only whitespace and {EOT!r} separators")


def _save_progress(out: Path, settings: dict, done: dict[int, dict]) -> None:
    partial = out / (PROGRESS + ".partial")
    partial.write_text(json.dumps({"settings": settings, "done": {str(k): v for k, v in done.items()}}))
    partial.replace(out / PROGRESS)


def _counter():
    """The progress counter the workers share: input bytes read, tokens written."""
    import multiprocessing

    return multiprocessing.get_context("spawn").Array("q", 2)


def _map(function, jobs: list, tokenizer_path: Optional[str], workers: int, counter=None) -> Iterator[dict]:
    """``function`` over ``jobs`` in ``workers`` processes (in this one for 1), as they finish.

    Spawned (no torch or thread state forked into them), and without the main module: a spawned
    process imports its parent's first (the CLI's: lightning, ~20 s each on a loaded machine)
    unless ``__main__`` has no spec and no file while it starts."""
    if workers <= 1 or len(jobs) <= 1:
        _load_worker(tokenizer_path, counter)
        yield from map(function, jobs)
        return
    import multiprocessing
    import types

    main, sys.modules["__main__"] = sys.modules["__main__"], types.ModuleType("__main__")
    try:
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_load_worker,
                                                         initargs=(tokenizer_path, counter))
    finally:
        sys.modules["__main__"] = main
    with pool:
        yield from pool.imap_unordered(function, jobs)


LOG_EVERY_S = 10.0  # a progress line this often when stderr is not a terminal


class _Progress:
    """Input bytes read of the total, tokens/s and an ETA on stderr, from the workers' shared
    counter: a bar refreshed twice a second on a terminal, a line every ``LOG_EVERY_S`` in a log."""

    def __init__(self, total_bytes: int, done_bytes: int, counter, show: bool) -> None:
        from tqdm import tqdm

        self.counter, self.total, self.done, self.start = counter, total_bytes, done_bytes, time.monotonic()
        self.terminal = show and sys.stderr.isatty()
        self.bar = tqdm(total=total_bytes, initial=done_bytes, unit="B", unit_scale=True, file=sys.stderr,
                        disable=not self.terminal, dynamic_ncols=True, desc="prepare")
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="prepare-progress") if show else None
        if self.thread is not None:
            self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(0.5 if self.terminal else LOG_EVERY_S):
            self.show()

    def show(self) -> None:
        read, tokens = self.counter[:]
        elapsed = max(time.monotonic() - self.start, 1e-9)
        if self.terminal:  # tqdm shows the bytes, their rate and the ETA
            self.bar.update(self.done + read - self.bar.n)
            self.bar.set_postfix_str(f"{tokens / elapsed:,.0f} tokens/s")
            return
        size = self.bar.format_sizeof
        left = self.total - self.done - read
        eta = f"{left / (read / elapsed):,.0f} s" if read else "?"
        print(f"prepare: {size(self.done + read, 'B')} of {size(self.total, 'B')} "
              f"({100 * (self.done + read) / max(self.total, 1):.0f}%), {tokens / elapsed:,.0f} tokens/s, ETA {eta}",
              file=sys.stderr, flush=True)

    def close(self, clear: bool = False) -> None:
        """``clear``: erase the bar (an error follows, alone on its line)."""
        if self.thread is not None:
            self.stopped.set()
            self.thread.join()
        if clear:
            self.bar.leave = False
        elif self.terminal:
            self.show()
        self.bar.close()


def main(argv: list[str]) -> int:
    """The ``prepare`` subcommand: 0 when done; PrepareError (exit 2 through the CLI) on bad input."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):  # one line, exit 2 through the CLI, instead of usage + exit
            raise PrepareError(f"prepare: {message}")

    parser = Parser(prog="titan-lightning prepare", description=__doc__.split("\n\n")[0], exit_on_error=False,
                    epilog=CHAT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", action="append", required=True,
                        help="file, folder or glob (repeatable): .jsonl, .json, .txt, .parquet; the first three "
                             "also compressed (.gz, .bz2, .xz, .zst)")
    parser.add_argument("--output", required=True, help="the shard folder to write")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json or its folder (default: the shipped one)")
    parser.add_argument("--text-field", default=None, help="the JSONL field / Parquet column with the text (default: "
                                                           "text)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
    parser.add_argument("--bad-records", default="skip", choices=("skip", "stop"))
    parser.add_argument("--shard-tokens", type=int, default=2**28, help="tokens per shard file at most (about)")
    parser.add_argument("--no-progress", action="store_true")
    chat = parser.add_argument_group("chat and instruction data (written with a loss mask; see below)")
    chat.add_argument("--chat", action="store_true", help="records hold conversations: a list of {role, content} "
                      "messages (roles system, user, assistant, tool)")
    chat.add_argument("--messages-field", default=None, help="with --chat: the field / column of the messages "
                      "(default: messages; ShareGPT's {from, value} messages: --messages-field conversations)")
    chat.add_argument("--tools-field", default=None, help="with --chat: the field / column of a record's tool "
                      "definitions, passed to the template as `tools` (default: tools; a record without it: none)")
    chat.add_argument("--prompt-field", default=None, help="records are prompt/response pairs: the prompt's field; "
                      "several, comma-separated, are joined by a blank line (Alpaca: instruction,input)")
    chat.add_argument("--response-field", default=None, help="the response's field (Alpaca: output)")
    chat.add_argument("--preference", action="store_true", help="records are preference pairs: a prompt (optional) "
                      "and a chosen and a rejected answer, each a text or a list of messages (see below)")
    chat.add_argument("--chosen-field", default=None, help="with --preference: the chosen answer's field (default: "
                      "chosen); --prompt-field names the prompt's (default: prompt)")
    chat.add_argument("--rejected-field", default=None, help="with --preference: the rejected answer's field "
                      "(default: rejected)")
    chat.add_argument("--chat-template", default=None, metavar="FILE",
                      help="a Jinja chat template instead of the tokenizer's")
    chat.add_argument("--train-on", default=None, choices=TRAIN_ON,
                      help="what the mask supervises: every assistant turn (default), the last one, or all tokens")
    chat.add_argument("--max-tokens", type=int, default=None, help="tokens per conversation at most")
    chat.add_argument("--too-long", default=None, choices=TOO_LONG,
                      help="a conversation over --max-tokens: drop it (default) or keep its first --max-tokens")
    try:
        options = parser.parse_args(argv)
    except argparse.ArgumentError as err:
        raise PrepareError(f"prepare: {err}") from None
    chat_options = _chat_options(options)
    summary = prepare(options.input, options.output, tokenizer_path=options.tokenizer,
                      text_field=options.text_field or "text", workers=options.workers,
                      bad_records=options.bad_records, shard_tokens=options.shard_tokens,
                      progress=not options.no_progress, chat=chat_options)
    skipped = (f"; {summary['bad_records']} bad record(s) skipped, the first: {summary['first_bad']}"
               if summary["bad_records"] else "")
    if isinstance(chat_options, PreferenceOptions):
        sft = summary["sft"]
        print(f"{options.output}: {summary['tokens']:,} tokens ({sft['supervised_tokens']:,} supervised), "
              f"{sft['pairs']:,} pairs in {summary['shards']} shard(s); {_fitted(sft)}{skipped}")
        return 0
    if chat_options is None:
        print(f"{options.output}: {summary['tokens']:,} tokens, {summary['documents']:,} documents in "
              f"{summary['shards']} shard(s){skipped}")
        return 0
    sft = summary["sft"]
    print(f"{options.output}: {summary['tokens']:,} tokens ({sft['supervised_tokens']:,} supervised, "
          f"--train-on {sft['train_on']}), {sft['conversations']:,} conversations in {summary['shards']} shard(s); "
          f"{_fitted(sft)}{skipped}")
    return 0


def _fitted(sft: dict[str, Any]) -> str:
    """What the summary says of the records truncated and dropped."""
    limit = sft["max_tokens"]
    return (f"{sft['truncated']:,} truncated, {sft['dropped']:,} dropped" if limit is None else
            f"{sft['truncated']:,} truncated, {sft['dropped']:,} dropped (over --max-tokens {limit})"
            if sft["too_long"] == "drop" else
            f"{sft['truncated']:,} truncated to --max-tokens {limit}, {sft['dropped']:,} dropped (nothing "
            f"supervised in their first {limit} tokens)")


CHAT_HELP = """\
chat and instruction data:
  --chat reads a list of {role, content} messages per record (--messages-field); --prompt-field
  and --response-field read prompt/response pairs, as a user turn and an assistant turn. Each
  conversation is rendered with the tokenizer folder's chat template (chat_template.jinja, or
  chat_template in tokenizer_config.json; --chat-template FILE overrides) and written with a
  loss mask: 1 on what the assistant says, its end-of-turn token included; 0 on system, user
  and tool turns and on the template's headers. A template with {% generation %} markers says
  itself what is supervised; one without a generation prompt (Mistral's [INST] ... [/INST])
  supervises all that follows the conversation before the turn. Prompt/response pairs with a
  tokenizer that has no chat template are plain text: the prompt, a blank line, the response and
  EOS, the mask on the response and EOS. With one --prompt-field, either field may hold a list
  of messages instead (TRL's conversational prompt-completion): the prompt's messages then the
  response's, only the response's assistant turns supervised (needs a chat template).
  --max-tokens with --too-long drop|truncate (truncate
  drops a conversation left with nothing supervised); the summary counts what was truncated and
  dropped. A record's tool definitions (--tools-field, default tools: a list of JSON-schema
  function objects, or a JSON string of one) are the template's `tools` in every render of it;
  an assistant turn that only calls tools (tool_calls, null content) is supervised as the
  template renders the calls. An assistant turn with "weight": 0 (OpenAI's format) is context,
  not supervised. ShareGPT records (--messages-field conversations: {from, value}
  messages from human, gpt, system, tool) are read as the {role, content} messages they stand
  for. A record without an assistant turn, with an unknown role, a
  content that is not a string (but for such a call), bad tools, or on which the template fails
  is a bad record (--bad-records).

  --preference reads preference pairs (TRL's formats): a prompt (--prompt-field, default prompt:
  a text as one user turn, or a list of messages) and two answers (--chosen-field,
  --rejected-field: a text as one assistant turn, or a list of messages that continue the
  prompt); without a prompt field, chosen and rejected are whole conversations and the prompt is
  the messages they share from the start. Each answer is rendered after the prompt as above, the
  mask on the answer's assistant turns; the two are written one after the other (chosen, then
  rejected) and kept or dropped together (--max-tokens applies to each). Train with
  --job.preference.loss dpo|ipo|simpo (recipes.hf:dpo).

  titan-lightning prepare --chat --input chats.jsonl --tokenizer path/to/hf-folder \\
      --output sft-shards/ --max-tokens 4096
  titan-lightning prepare --input alpaca.jsonl --prompt-field instruction,input \\
      --response-field output --tokenizer path/to/hf-folder --output sft-shards/
  titan-lightning prepare --preference --input pairs.jsonl --tokenizer path/to/hf-folder \\
      --output dpo-shards/ --max-tokens 1024
"""


def _chat_options(options) -> Optional[ChatOptions]:
    """The chat options given on the command line (None: plain text); one line for a combination
    that does not go together."""
    if options.preference:
        return _preference_options(options)
    for name in ("chosen_field", "rejected_field"):
        if getattr(options, name) is not None:
            raise PrepareError(f"--{name.replace('_', '-')} {getattr(options, name)!r} names an answer of a "
                               f"preference pair; add --preference")
    pairs = options.prompt_field is not None or options.response_field is not None
    if options.messages_field is not None and not options.chat:
        raise PrepareError(f"--messages-field {options.messages_field!r} applies to conversations; add --chat")
    if options.tools_field is not None and not options.chat:
        raise PrepareError(f"--tools-field {options.tools_field!r} applies to conversations; add --chat")
    if not options.chat and not pairs:
        given = [name for name in ("chat_template", "train_on", "max_tokens", "too_long")
                 if getattr(options, name) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise PrepareError(f"{flag} applies to chat and instruction data; add --chat (messages) or "
                               f"--prompt-field and --response-field (pairs)")
        return None
    if options.text_field is not None:
        raise PrepareError("--text-field names plain text; conversations are read from --messages-field "
                           "(--chat) or --prompt-field/--response-field")
    _check_too_long(options)
    try:
        return ChatOptions(messages_field=(options.messages_field or "messages") if options.chat else None,
                           tools_field=options.tools_field or "tools",
                           prompt_fields=tuple(f.strip() for f in (options.prompt_field or "").split(",") if f.strip()),
                           response_field=options.response_field, template=options.chat_template,
                           train_on=options.train_on or "assistant", max_tokens=options.max_tokens,
                           too_long=options.too_long or "drop")
    except ValueError as err:
        raise PrepareError(str(err)) from None


def _preference_options(options) -> PreferenceOptions:
    """``--preference``'s options; one line for an option of another kind of data."""
    for flag, value in (("--chat", options.chat or None), ("--response-field", options.response_field),
                        ("--messages-field", options.messages_field), ("--tools-field", options.tools_field),
                        ("--text-field", options.text_field), ("--train-on", options.train_on)):
        if value is not None:
            raise PrepareError(f"{flag} does not apply to --preference (pairs are read from --prompt-field, "
                               f"--chosen-field and --rejected-field; each answer's assistant turns supervised)")
    _check_too_long(options)
    try:
        return PreferenceOptions(prompt_fields=(options.prompt_field or "prompt",),
                                 chosen_field=options.chosen_field or "chosen",
                                 rejected_field=options.rejected_field or "rejected",
                                 response_field=options.chosen_field or "chosen", template=options.chat_template,
                                 max_tokens=options.max_tokens, too_long=options.too_long or "drop")
    except ValueError as err:
        raise PrepareError(str(err)) from None


def _check_too_long(options) -> None:
    if options.too_long is not None and options.max_tokens is None:
        raise PrepareError(f"--too-long {options.too_long} needs --max-tokens N (the limit it applies to)")
