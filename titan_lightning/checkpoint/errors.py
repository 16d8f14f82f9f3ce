"""What went wrong in a save or a load, in one line."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Optional

from torch.distributed.checkpoint.api import CheckpointException


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message is one line naming the folder or file."""


class NotACheckpointError(CheckpointError, ValueError):
    """A path to load that holds no checkpoint (Lightning's ModelParallelStrategy raises ValueError)."""


class CheckpointIsADirectoryError(CheckpointError, IsADirectoryError):
    """A full checkpoint's path is a folder that is no checkpoint (ModelParallelStrategy: IsADirectoryError)."""


_FAILURES = (Exception, CheckpointException)



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

