"""Saving: Lightning checkpoints as sharded, atomic folders (``CheckpointWriter``).

A save is written to ``<name>.partial``, completed by ``meta.pt`` (Lightning's part of the
checkpoint, with the manifest of ours and every rank's state inside: the folder holds just the files
Lightning's ModelParallelStrategy writes) and renamed when every rank is done; a save that fails
removes its ``.partial`` and raises one line on every rank. An asynchronous save stages the tensors
to CPU memory and writes them in a background thread. Every shard's [bytes, crc32] is computed while
it is written, for the manifest.
"""

from __future__ import annotations

import copy
import io
import os
import shutil
import sys
import threading
import time
import weakref
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from titan_lightning._compat import default_group
from titan_lightning.checkpoint import hooks
from titan_lightning.checkpoint.errors import _FAILURES, CheckpointError, _describe
from titan_lightning.checkpoint.files import DCP_METADATA, FORMAT, MANIFEST_KEY, META, PARTIAL
from titan_lightning.checkpoint.placements import dcp_saveable


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
        number = self._saves
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
        hooks.at("begin", save=number)
        ranks = self.agree(lambda: self._gather(rank_state), fail)  # (kilobytes a rank: RNG states, data position)
        manifest = {"format": FORMAT, "global_step": int(checkpoint.get("global_step", -1)),
                    "world_size": world_size, "layout": rank_state.get("layout")}
        if async_save:
            checkpoint = copy.deepcopy(checkpoint)  # (written after training has moved on)
        writer = _ChecksummingWriter(staging)
        hooks.at("files", save=number, storage=writer)

        def finish() -> None:
            hooks.at("written", save=number)
            if rank == 0:  # DCP's coordinator wrote .metadata last, after every rank's data; meta.pt completes it
                files = dict(sorted(writer.checksums.items()))
                _save_small({**checkpoint, MANIFEST_KEY: {**manifest, "files": files, "ranks": ranks}},
                            staging / META, sync=True)
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

    def _gather(self, rank_state: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's state, in rank order, on every rank (rank 0 writes them into meta.pt)."""
        if not _distributed():
            return [rank_state]
        if dist.get_backend() == "fake":  # (every simulated rank is this process)
            return [rank_state] * dist.get_world_size()
        states: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(states, rank_state, group=self.group)
        return states

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
        raises CheckpointError (a CheckpointError's own subclass and message where one was raised)
        with the first failure's message (no rank is left in a collective)."""
        try:
            result, error = action(), None
        except _FAILURES as caught:
            result = None
            if isinstance(caught, CheckpointError) and type(caught) is not CheckpointError:
                error = (str(caught), type(caught))
            else:
                error = (fail(caught) if fail else str(caught) if isinstance(caught, CheckpointError)
                         else _describe(caught))
        self._agree(error)
        return result

    def _agree(self, error: Union[str, tuple[str, type], None]) -> None:
        """``error``: this rank's message, or (message, CheckpointError subclass to raise)."""
        errors = [error]
        if _distributed():
            errors = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(errors, error, group=self.group)
        for rank, failure in enumerate(errors):
            if failure is not None:
                message, kind = failure if isinstance(failure, tuple) else (failure, CheckpointError)
                raise kind(message if failure == error else f"{message} (on rank {rank})")


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



class _ChecksummingWriter(FileSystemWriter):
    """DCP's FileSystemWriter that records [bytes, crc32] of every file it writes; after ``finish``
    the coordinator's ``checksums`` holds every rank's files and .metadata."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self._written: dict[str, list[int]] = {}
        self.fs = _ChecksumFileSystem(self.fs, self._written)
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



def _save_small(value: Any, file: Path, *, sync: bool = False) -> list[int]:
    """torch.save through memory, then one plain write: a failed write is the OS's own error (ENOSPC,
    EACCES), not torch's zip writer's. ``sync``: on disk before the folder is renamed. Returns
    [bytes, crc32] of the file."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    with open(file, "wb") as f:
        f.write(buffer.getbuffer())
        if sync:
            f.flush()
            os.fsync(f.fileno())
    return [buffer.getbuffer().nbytes, zlib.crc32(buffer.getbuffer())]


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

