"""Distributed checkpoints through Lightning's own flow (ModelCheckpoint, ``Trainer.save_checkpoint``,
``fit(ckpt_path=...)``), for every layout TitanStrategy builds.

A checkpoint is a folder::

    epoch=0-step=5.ckpt/
        .metadata, __<rank>_0.distcp   model and optimizer, sharded (torch.distributed.checkpoint)
        meta.pt                        the rest of Lightning's checkpoint (loops, LR schedulers, callbacks ...)
        rank<r>.pt                     what differs per rank: RNG states, the data module's position
        checkpoint.json                the completion manifest, written last: step, world size, and every
                                       other file's size and crc32 (computed while it was written)

- Model and optimizer are saved by name (the unsplit module names, the optimizer state
  flattened per parameter), so a checkpoint loads on any other layout: another FSDP degree,
  TP, PP stages (each rank reads only its stages' keys). A DTensor whose shard is several pieces
  of the tensor (TP's ``colwise_fused``: [q_r; k_r; v_r]) is saved replicated, in the module's own
  rows, and each rank reads its pieces back out of it.
- A save is atomic: it is written to ``<name>.partial``, completed by its manifest and
  renamed when every rank is done. A run killed at any moment of a save leaves the previous
  checkpoints intact and at most a ``.partial`` folder, which ``latest`` skips. A save that
  fails (disk full, permission denied) removes its ``.partial`` and raises one line naming
  the folder and the OS error, on every rank.
- ``async_save``: the tensors are staged to CPU memory, then written in a background thread
  while training goes on; its collectives run on a process group of their own (gloo), so they
  never interleave with training's. The manifest and the rename follow as soon as the write ends.
- Before a run starts from a checkpoint, every file the manifest lists is checked: present, of its
  size, and (``checkpoint.verify_checksums``, the default) of its crc32, so a flipped bit in a
  weight or a truncated shard is named before launch instead of training a wrong model. A
  checkpoint saved before checksums were recorded is checked for its files and their sizes only.
- Loading runs no code from the files: ``meta.pt`` and ``rank<r>.pt`` are read with
  ``torch.load(weights_only=True)``, DCP's pickled ``.metadata`` with an unpickler that admits
  only DCP's own metadata classes, and DCP's non-tensor items with ``weights_only=True``;
  ``latest`` reads only the JSON manifests.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import random
import shutil
import sys
import threading
import time
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from titan_lightning._compat import StridedShard, compute_local_shape_and_global_offset, default_group
from titan_lightning._compat import flatten_state_dict, set_element

# Fault injection for tests: ``N`` or ``N:MOMENT`` makes the process die (exit 137) in its N-th
# save at MOMENT: "begin" (the .partial folder made), "files" (meta.pt and the rank files written;
# the default), "written" (the shards written, before the manifest and the rename). ``N:enospc``
# makes every rank's N-th save fail writing its shards with "No space left on device".
FAULT_ENV = "TITAN_LIGHTNING_FAULT_IN_SAVE"
FAULT_MOMENTS = ("begin", "files", "written", "enospc")

META = "meta.pt"
MANIFEST = "checkpoint.json"
PARTIAL = ".partial"
DCP_METADATA = ".metadata"
FORMAT = "titan_lightning/1"
# A manifest is a few hundred bytes; anything much larger is not ours and is not parsed.
_MANIFEST_MAX_BYTES = 1 << 20


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message is one line naming the folder or file."""


# -- what differs per rank ----------------------------------------------------------------


def rng_states() -> dict[str, Any]:
    """Every RNG's state as tensors and plain values (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    n = states["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# -- locating checkpoints ------------------------------------------------------------------


def read_manifest(path: Path) -> Optional[dict[str, Any]]:
    """The completion manifest of the checkpoint folder ``path``, or None when it has no valid one.

    Reads one small JSON file and nothing else: safe on folders nobody here wrote."""
    file = path / MANIFEST
    try:
        if not file.is_file() or file.stat().st_size > _MANIFEST_MAX_BYTES:
            return None
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    if not isinstance(manifest.get("global_step"), int) or not isinstance(manifest.get("world_size"), int):
        return None
    return manifest


def is_complete(path: Path) -> bool:
    return (path.is_dir() and not path.name.endswith(PARTIAL) and read_manifest(path) is not None
            and (path / META).is_file() and (path / DCP_METADATA).is_file())


def latest_checkpoint(root: Union[str, Path]) -> Optional[Path]:
    """The complete checkpoint with the highest global step under ``root`` (searched recursively).

    Only the manifests are read; no checkpoint is loaded to decide."""
    best, best_key = None, None
    for file in Path(root).rglob(MANIFEST):
        folder = file.parent
        if not is_complete(folder):
            continue
        key = (read_manifest(folder)["global_step"], file.stat().st_mtime)
        if best_key is None or key > best_key:
            best, best_key = folder, key
    return best


def resolve_resume(resume_from: Optional[str], runs_root: Path, *, checksums: bool = True) -> Optional[str]:
    """``resume_from`` as a checkpoint path: None, a checkpoint folder, or "latest" (the newest
    under ``runs_root``; None when there is none yet: the run starts fresh). Its files are checked
    (``check_files``; ``checksums``: their crc32 too) and meta.pt read, without running code."""
    if resume_from is None:
        return None
    if resume_from == "latest":
        found = latest_checkpoint(runs_root)
        if found is None:
            return None
        path, what = found, f"checkpoint.resume_from='latest' ({found})"
    else:
        path, what = Path(resume_from), f"checkpoint.resume_from={resume_from!r}"
        if not path.exists():
            raise CheckpointError(f"{what} does not exist; give a checkpoint folder "
                                  f"(<run>/checkpoints/epoch=...-step=....ckpt) or 'latest'")
    check_files(path, verify(path, what=what), what=what, checksums=checksums)
    load_meta(path)  # readable without running code, before any process starts
    return str(path)


def unfinished_checkpoints(root: Union[str, Path]) -> list[Path]:
    """Folders under ``root`` with shards but no valid manifest: saves that did not finish, or
    checkpoints of a titan_lightning that wrote no manifest (neither is resumed from)."""
    return sorted(metadata.parent for metadata in Path(root).rglob(DCP_METADATA)
                  if (metadata.parent / META).exists() and read_manifest(metadata.parent) is None)


def is_lightning_sharded(path: Path) -> bool:
    """A finished sharded checkpoint of Lightning's ModelParallelStrategy (or FSDPStrategy): DCP's
    ``.metadata`` and Lightning's ``meta.pt``, no manifest of ours (ours are renamed into place
    with theirs, so a folder of ours is never without it)."""
    return (path.is_dir() and not path.name.endswith(PARTIAL) and (path / DCP_METADATA).is_file()
            and (path / META).is_file() and not (path / MANIFEST).exists())


def verify(path: Path, *, what: Optional[str] = None, ranks: bool = True) -> dict[str, Any]:
    """Fail with one line unless ``path`` is a complete checkpoint whose files are all there;
    returns its manifest. ``ranks``: also check every rank file the manifest lists."""
    what = what or f"checkpoint {path}"
    if not path.is_dir():
        raise CheckpointError(f"{what} is a file; TitanStrategy checkpoints are folders (sharded)")
    manifest = read_manifest(path)
    if manifest is None:
        inner = latest_checkpoint(path)
        hint = (f"; it holds checkpoints, the newest is {inner}" if inner is not None
                else "; a save that did not finish leaves such a folder (.partial)" if (path / META).exists()
                else "")
        raise CheckpointError(f"{what} is not a complete checkpoint (no valid {MANIFEST}){hint}")
    names = [DCP_METADATA, META] + ([rank_file(r) for r in range(manifest["world_size"])] if ranks else [])
    for name in names:
        if not (path / name).is_file():
            raise CheckpointError(f"{what}: {name} is missing (saved by {manifest['world_size']} ranks)")
    return manifest


def check_files(path: Path, manifest: Optional[dict[str, Any]], *, what: Optional[str] = None,
                checksums: bool = True) -> None:
    """Fail with one line naming the first file of the checkpoint ``path`` that is missing, of
    another size than saved, or (``checksums``) of another crc32; then read its .metadata (no code
    run) and check that every shard it points into is there and long enough. A manifest without
    ``files`` (saved before checksums were recorded) or None (an export) gets the last part only."""
    what = what or f"checkpoint {path}"
    files = _listed_files(manifest, what) if manifest is not None else {}
    for name, (size, _) in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{what}: {name} is missing (the checkpoint was saved with it)")
        found = file.stat().st_size
        if found != size:
            state = "truncated" if found < size else "longer than saved"
            raise CheckpointError(f"{what}: {name} is {state} ({found} bytes, {size} when saved); the file "
                                  f"changed after the save: use another checkpoint")
    if checksums and files:
        names = list(files)
        with ThreadPoolExecutor(max_workers=min(8, len(names))) as pool:  # zlib releases the GIL
            found_crcs = list(pool.map(lambda name: _crc32(path / name), names))
        for name, crc in zip(names, found_crcs):
            if crc != files[name][1]:
                raise CheckpointError(
                    f"{what}: {name} is corrupt (crc32 {crc:08x}, {files[name][1]:08x} when saved); use another "
                    f"checkpoint, or load it anyway with checkpoint.verify_checksums=false")
    if not (path / DCP_METADATA).is_file():
        raise CheckpointError(f"{what}: {DCP_METADATA} is missing")
    _check_shards(path, read_dcp_metadata(path, what), what)


def check_model_shapes(path: Path, shapes: dict[str, tuple[int, ...]], what: str) -> None:
    """Fail with one line unless the checkpoint ``path`` holds exactly the model tensors ``shapes``
    names (``state_dict.<name>``, global shapes), naming the first that differs and both shapes.
    Reads only DCP's .metadata: before launch, on the model built on the meta device."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = read_dcp_metadata(path, what).state_dict_metadata
    prefix = "state_dict."
    theirs = {key[len(prefix):]: tuple(meta.size) for key, meta in saved.items()
              if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    hint = "; give the model it was saved with (job.model), or a checkpoint of this model"
    for name, shape in shapes.items():
        if name not in theirs:
            raise CheckpointError(f"{what} holds no {name}, which this run's model has ({tuple(shape)}): it is a "
                                  f"checkpoint of another model{hint}")
        if theirs[name] != tuple(shape):
            raise CheckpointError(f"{what}: {name} is {theirs[name]} there, {tuple(shape)} in this run's "
                                  f"model{hint}")
    extra = [name for name in theirs if name not in shapes]
    if extra:
        raise CheckpointError(f"{what} holds {extra[0]} {theirs[extra[0]]}, which this run's model has not"
                              f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}: it is a checkpoint "
                              f"of another model{hint}")


def _listed_files(manifest: dict[str, Any], what: str) -> dict[str, tuple[int, int]]:
    """The manifest's ``files`` as {name: (bytes, crc32)}; {} when it has none. Names are plain file
    names of the folder (a crafted manifest cannot send the check elsewhere)."""
    files = manifest.get("files")
    if files is None:
        return {}
    ok = isinstance(files, dict) and all(
        isinstance(name, str) and name and "/" not in name and "\\" not in name and name not in (".", "..")
        and isinstance(entry, list) and len(entry) == 2 and all(isinstance(v, int) and v >= 0 for v in entry)
        for name, entry in files.items())
    if not ok:
        raise CheckpointError(f"{what}: {MANIFEST} lists its files in a form not written here; it was changed "
                              f"after the save")
    return {name: (entry[0], entry[1]) for name, entry in files.items()}


def _crc32(file: Path, chunk: int = 16 << 20) -> int:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def _check_shards(path: Path, metadata: Any, what: str) -> None:
    """Every shard file DCP's metadata points into is there and holds the bytes it points at."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{what}: shard file {name} is missing")
        if file.stat().st_size < size:
            raise CheckpointError(f"{what}: shard file {name} is truncated ({file.stat().st_size} of {size} bytes)")


# -- save ----------------------------------------------------------------------------------


def _fault(save_number: int) -> Optional[str]:
    """The moment the fault-injection variable names for this save, if any."""
    value = os.environ.get(FAULT_ENV)
    if not value:
        return None
    number, _, moment = value.partition(":")
    return (moment or "files") if number == str(save_number) else None


def _die_at(moment: str, planned: Optional[str]) -> None:
    if planned == moment:
        os._exit(137)


# What a save or load step may raise: any Exception, and DCP's CheckpointException (a
# BaseException that wraps each rank's failure).
_FAILURES = (Exception, CheckpointException)


class _Pending:
    """An asynchronous save in flight: waits for its write, then finishes it, in a thread of its own."""

    def __init__(self, future: Any, finish: Callable[[], None], fail: Callable[[BaseException], str]) -> None:
        self.error: Optional[str] = None
        self.then: list[Callable[[], None]] = []  # after a successful finish (older checkpoints removed)
        self._thread = threading.Thread(target=self._run, args=(future, finish, fail), daemon=True,
                                        name="titan-lightning-checkpoint")
        self._thread.start()

    def _run(self, future: Any, finish: Callable[[], None], fail: Callable[[BaseException], str]) -> None:
        try:
            done = getattr(future, "upload_completion", future)  # AsyncSaveResponse or Future
            done.result()
            finish()
            for action in self.then:
                action()
        except BaseException as error:  # noqa: BLE001 - reported on the main thread by wait()
            self.error = fail(error)

    def wait(self) -> Optional[str]:
        self._thread.join()
        return self.error

    def done(self) -> bool:
        return not self._thread.is_alive()


class CheckpointWriter:
    """Saves Lightning checkpoints as sharded, atomic folders; one per strategy.

    ``group`` carries the checkpoint's own collectives (DCP's planning, agreeing on failures):
    a gloo group apart from training's, so a save in the background never interleaves with a
    training collective. None: the default group (one process, or the fake backend).
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self._pending: Optional[_Pending] = None
        self._announced: Optional[tuple[Path, float]] = None  # (path, start) of an announced save in flight
        self._saves = 0

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is complete under its final name;
        raise on every rank if it failed on any."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        announced, self._announced = self._announced, None
        if announced is not None and not pending.done():
            say(f"checkpoint {announced[0]}: waiting for the background write")
        self._agree(pending.wait())
        if announced is not None:
            say(f"checkpoint {announced[0]}: written ({time.monotonic() - announced[1]:.1f} s since the save began)")

    def save(self, checkpoint: dict[str, Any], path: Path, *, rank: int, rank_state: dict[str, Any],
             async_save: bool = False, announce: bool = False) -> None:
        """``announce``: say on rank 0 when the save begins and ends (and how long it took): for the
        saves after the last step, when nothing else shows that the run is still working."""
        import torch.distributed.checkpoint as dcp

        self.wait()  # one save at a time, in order
        begun = time.monotonic()
        if announce:
            say(f"checkpoint {path}: saving{' (staged, then written in the background)' if async_save else ''}")
        self._saves += 1
        fault = _fault(self._saves)
        staging = path.with_name(path.name + PARTIAL)
        world_size = dist.get_world_size() if _distributed() else 1

        def fail(error: BaseException) -> str:
            reason = _describe(error, folder=staging.parent)
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            return f"saving checkpoint {path} failed: {reason}"

        def prepare() -> None:
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)

        state = {"state_dict": checkpoint.pop("state_dict")}
        for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{index}"] = optimizer_state
        state = dcp_saveable(state)
        self.agree(prepare, fail)
        _die_at("begin", fault)
        manifest = {"format": FORMAT, "global_step": int(checkpoint.get("global_step", -1)),
                    "world_size": world_size, "layout": rank_state.get("layout")}

        def write_own_files() -> dict[str, list[int]]:
            written = {rank_file(rank): _save_small(rank_state, staging / rank_file(rank))}
            if rank == 0:
                written[META] = _save_small(checkpoint, staging / META)
            return written

        own = self.agree(write_own_files, fail)
        _die_at("files", fault)
        writer = _ChecksummingWriter(staging, own, full_disk=fault == "enospc")

        def finish() -> None:
            _die_at("written", fault)
            if rank == 0:  # DCP's coordinator wrote .metadata last, after every rank's data
                _write_json(staging / MANIFEST, {**manifest, "files": dict(sorted(writer.checksums.items()))})
                _replace_dir(staging, path)

        if not async_save:
            self.agree(lambda: dcp.save(state, checkpoint_id=str(staging), storage_writer=writer,
                                        process_group=self.group), fail)
            self.agree(finish, fail)
            if announce:
                say(f"checkpoint {path}: saved ({time.monotonic() - begun:.1f} s)")
            return
        future = dcp.async_save(state, checkpoint_id=str(staging), storage_writer=writer, process_group=self.group)
        self._pending = _Pending(future, finish, fail)
        if announce:
            say(f"checkpoint {path}: staged ({time.monotonic() - begun:.1f} s), writing in the background")
            self._announced = (path, begun)

    def remove(self, path: Path, *, rank: int) -> None:
        """Delete a checkpoint (keep_latest_k), on rank 0: after the save in flight completes (never
        leaving fewer complete checkpoints than asked), renamed to ``.partial`` first (never leaving
        a half-deleted folder that looks complete)."""
        if rank != 0:
            return
        if self._pending is not None:
            self._pending.then.append(lambda: _remove_dir(path))
        else:
            _remove_dir(path)

    def agree(self, action: Callable[[], Any], fail: Optional[Callable[[BaseException], str]] = None) -> Any:
        """Run ``action`` on every rank and return its result; if it raised anywhere, every rank
        raises CheckpointError with the first failure's message (no rank is left in a collective)."""
        try:
            result, error = action(), None
        except _FAILURES as caught:
            result = None
            error = fail(caught) if fail else str(caught) if isinstance(caught, CheckpointError) else _describe(caught)
        self._agree(error)
        return result

    def _agree(self, error: Optional[str]) -> None:
        errors = [error]
        if _distributed():
            errors = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(errors, error, group=self.group)
        for rank, message in enumerate(errors):
            if message is not None:
                raise CheckpointError(message if message == error else f"{message} (on rank {rank})")


def say(message: str) -> None:
    """One progress line on rank 0, above the progress bar if one is showing."""
    if _distributed() and dist.get_rank() != 0:
        return
    from tqdm import tqdm

    tqdm.write(f"titan-lightning: {message}")
    sys.stdout.flush()


def _remove_dir(path: Path) -> None:
    if path.exists():
        doomed = path.with_name(path.name + PARTIAL)
        shutil.rmtree(doomed, ignore_errors=True)
        path.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


# -- checksums, computed while writing ------------------------------------------------------
#
# Every file of a checkpoint is listed in its manifest as [bytes, crc32]. The crc32 is computed
# from the bytes as they go to the file (DCP's writes pass through ``_CountingStream``), so a save
# reads nothing back. Each rank's list travels to DCP's coordinator (rank 0) with DCP's own write
# results, as one more result that ``_ChecksummingWriter.finish`` takes out again.

_CHECKSUMS = "titan_lightning/checksums"  # the extra write result's key; never reaches .metadata


class _CountingStream:
    """A writable stream that adds up the size and crc32 of what passes through it."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.size, self.crc = inner, 0, 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.crc, self.size = zlib.crc32(view, self.crc), self.size + view.nbytes
        return self._inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _ChecksumFileSystem:
    """DCP's file system, recording [bytes, crc32] of each file written into ``files`` (by name)."""

    def __init__(self, inner: Any, files: dict[str, list[int]]) -> None:
        self._inner, self._files = inner, files

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: Any, mode: str):
        with self._inner.create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            counted = _CountingStream(stream)
            yield counted
        self._files[Path(path).name] = [counted.size, counted.crc]


class _FaultyFileSystem:
    """DCP's file system as seen by a full disk: every data file write fails with ENOSPC."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create_stream(self, path: Any, mode: str):
        if "w" in mode and str(path).endswith(".distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return self._inner.create_stream(path, mode)


class _ChecksummingWriter(FileSystemWriter):
    """DCP's FileSystemWriter that records [bytes, crc32] of every file it writes; after ``finish``
    the coordinator's ``checksums`` holds every rank's files, ``own`` (this rank's files written
    outside DCP) and .metadata. ``full_disk``: every shard write fails with ENOSPC (fault injection)."""

    def __init__(self, path: Path, own: dict[str, list[int]], *, full_disk: bool = False) -> None:
        super().__init__(str(path))
        self._written: dict[str, list[int]] = dict(own)
        self.fs = _ChecksumFileSystem(self.fs, self._written)
        if full_disk:
            self.fs = _FaultyFileSystem(self.fs)
        self.checksums: dict[str, list[int]] = {}

    def write_data(self, plan: Any, planner: Any) -> Future:
        results = super().write_data(plan, planner).wait()  # (FileSystemWriter writes before it returns)
        done: Future = Future()
        done.set_result([*results, WriteResult(index=MetadataIndex(_CHECKSUMS), size_in_bytes=0,
                                               storage_data=dict(self._written))])
        return done

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        ours = [r.storage_data for rank in results for r in rank if r.index.fqn == _CHECKSUMS]
        super().finish(metadata, [[r for r in rank if r.index.fqn != _CHECKSUMS] for rank in results])
        for files in ours:
            self.checksums.update(files)
        self.checksums[DCP_METADATA] = self._written.pop(DCP_METADATA + ".tmp")  # (renamed when complete)


def _describe(error: BaseException, folder: Optional[Path] = None) -> str:
    """One line for what went wrong: the OS error and its file, or DCP's first per-rank failure.

    ``folder``: where a save wrote. torch.save reports a failed write as its zip writer's own
    error ("unexpected pos ..."); when that folder's disk is full, say so."""
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if failures:
        rank, cause = next(iter(failures.items()))
        cause = cause[0] if isinstance(cause, tuple) else cause
        return f"{_describe(cause, folder)} (rank {rank})"
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return f"[Errno {error.errno}] {error.strerror}{where}"
    free = _free_bytes(folder) if folder is not None else None
    if free is not None and free < _FULL_DISK_BYTES:
        return f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: {free} bytes free under {folder}"
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{type(error).__name__}: {text[:300]}"


# A disk with less room than this is full for a checkpoint (its shards are megabytes at least).
_FULL_DISK_BYTES = 1 << 20


def _free_bytes(folder: Path) -> Optional[int]:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _save_small(value: Any, file: Path) -> list[int]:
    """torch.save through memory, then one plain write: a failed write is the OS's own error (ENOSPC,
    EACCES), not torch's zip writer's. Returns [bytes, crc32] of the file."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    with open(file, "wb") as f:
        f.write(buffer.getbuffer())
    return [buffer.getbuffer().nbytes, zlib.crc32(buffer.getbuffer())]


def _write_json(file: Path, value: dict[str, Any]) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(staging: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)  # complete too: `latest` may pick it if a kill lands right here
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def checkpoint_group() -> Any:
    """A gloo group over every rank for the checkpoints' collectives (None without a real process group).

    Called by every rank at the same point (a new group is a collective)."""
    if not _distributed() or dist.get_backend() == "fake":
        return None
    default = default_group()
    cached = _CHECKPOINT_GROUP.get("default")
    if cached is None or cached() is not default:  # (one per process group: a second fit reuses it)
        # Also for one rank: DCP's async save needs a CPU backend (not NCCL). Weak references: a
        # destroyed group (and its store's port) is not kept alive here.
        _CHECKPOINT_GROUP.update(default=weakref.ref(default), group=weakref.ref(dist.new_group(backend="gloo")))
    return _CHECKPOINT_GROUP["group"]()


_CHECKPOINT_GROUP: dict[str, Any] = {}


# -- load ----------------------------------------------------------------------------------


# What DCP's .metadata may name: its own metadata classes and the few torch values they hold.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "pathlib._local": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and refuses every other global: a crafted file cannot call anything."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _METADATA_GLOBALS.get(module, ())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"refused global {module}.{name} (not a DCP metadata class)")
        return super().find_class(module, name)


def _safe_reader(path: Path):
    """torch's FileSystemReader, its pickled .metadata read by ``_MetadataUnpickler``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            rank = kwargs.get("rank")
            name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
            with open(Path(self.path) / name, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"{name} holds a {type(metadata).__name__}, not DCP Metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


def _safe_planner():
    """DCP's default load planner, its non-tensor items read with ``weights_only=True``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner()


def read_dcp_metadata(path: Path, what: Optional[str] = None):
    """DCP's metadata of the folder ``path``, read without running code; one-line errors."""
    try:
        return _safe_reader(path).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, AttributeError, ImportError, IndexError,
            KeyError, TypeError, MemoryError, OverflowError) as error:
        raise CheckpointError(f"{what or f'checkpoint {path}'}: cannot read {DCP_METADATA} ({_describe(error)})") from None


def check_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Fail with one message naming ``path`` and what is missing or mismatched, before reading tensors."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import DTensor

    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a file; TitanStrategy checkpoints are folders (sharded)")
    absent = [name for name in (DCP_METADATA,) if not (path / name).is_file()]
    if absent or path.name.endswith(PARTIAL):
        raise CheckpointError(
            f"checkpoint {path} is incomplete (missing {', '.join(absent) or 'nothing, but it is a .partial folder'}): "
            f"a save that did not finish; resume from an earlier checkpoint"
        )
    metadata = read_dcp_metadata(path)
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state)
    missing = sorted(k for k in flat if k not in saved)
    mismatched = []
    for key, value in flat.items():
        meta = saved.get(key)
        if isinstance(value, (torch.Tensor, DTensor)) and isinstance(meta, TensorStorageMetadata):
            if tuple(meta.size) != tuple(value.shape):
                mismatched.append(f"{key}: saved {tuple(meta.size)}, model {tuple(value.shape)}")
    if missing or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} keys missing ({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})")
        if mismatched:
            parts.append(f"shapes differ ({'; '.join(mismatched[:3])}{' ...' if len(mismatched) > 3 else ''})")
        raise CheckpointError(f"checkpoint {path} does not match this run: {'; '.join(parts)}")
    _check_shards(path, metadata, f"checkpoint {path}")


def load_sharded(path: Path, state: dict[str, Any], group: Any = None) -> None:
    """Read ``state`` (tensors updated in place) from the checkpoint folder ``path``.

    A DTensor whose shard DCP cannot describe (see ``dcp_saveable``) is read replicated along
    the dims it splits into pieces, then each rank copies its own pieces out of it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import empty

    check_checkpoint(path, state)
    swapped = []  # (container, key, the caller's DTensor, what DCP reads into)
    for container, key, value in _dtensor_slots(state):
        placements = _one_chunk_placements(value, str(key))
        if placements is not None:
            readable = empty(value.shape, dtype=value.dtype, device_mesh=value.device_mesh, placements=placements)
            swapped.append((container, key, value, readable))
            container[key] = readable
    try:
        dcp.load(state, storage_reader=_safe_reader(path), planner=_safe_planner(), process_group=group)
    except _FAILURES as error:
        raise CheckpointError(f"checkpoint {path}: reading the shards failed ({_describe(error)}); "
                              f"the files may be truncated or corrupt") from error
    finally:
        for container, key, value, _ in swapped:
            container[key] = value
    for _, _, value, readable in swapped:
        value.to_local().copy_(readable.redistribute(value.device_mesh, value.placements).to_local())


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
    """Lightning's part of the checkpoint (loops, schedulers, callbacks, hyperparameters)."""
    meta = _load_small(path / META, weights_only=weights_only)
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint file {path / META} holds a {type(meta).__name__}, not a checkpoint dict")
    return meta


def load_rank_state(path: Path, rank: int) -> dict[str, Any]:
    state = _load_small(path / rank_file(rank))
    if not isinstance(state, dict) or "rng" not in state:
        raise CheckpointError(f"checkpoint file {path / rank_file(rank)} is not a rank state (no 'rng')")
    return state


# -- full (unsharded) weights into a sharded model -----------------------------------------


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
        if isinstance(target, DTensor):
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


# -- shards DCP cannot describe ----------------------------------------------------------------
#
# DCP records each rank's shard of a DTensor as one block of the global tensor (an offset and a
# size per dim). A ``_StridedShard`` may give a rank several pieces instead: TP's
# ``colwise_fused:N`` gives rank r its part of each of N blocks of rows ([q_r; k_r; v_r]), which
# DCP would place wrongly (its save refuses: "overlapping chunks"). Such a DTensor is saved and
# read replicated along the dims it splits into pieces: the unsplit rows, in the module's own
# layout, which every other layout reads.


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
