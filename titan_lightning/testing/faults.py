"""Faults injected into checkpoint saves, for tests (through ``titan_lightning.checkpoint.hooks``).

``TITAN_LIGHTNING_FAULT_IN_SAVE=N[:MOMENT]`` in a test rank's environment makes the rank die
(exit 137, as when killed) in its N-th save at MOMENT: "begin" (the .partial folder made),
"files" (every rank's state gathered, the shards not yet written; the default), "written" (the
shards written, before meta.pt with the manifest and the rename). ``N:enospc`` makes its N-th save fail writing its shards
with "No space left on device". The test worker (``titan_lightning.testing.worker``) installs it;
``titan-lightning`` itself never reads the variable.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import Any, Optional

from titan_lightning.checkpoint import hooks

FAULT_ENV = "TITAN_LIGHTNING_FAULT_IN_SAVE"
FAULT_MOMENTS = (*hooks.MOMENTS, "enospc")


class SaveFault:
    """The hook for ``hooks.install``: at ``moment`` of the ``save``-th save, die or fill the disk."""

    def __init__(self, save: int, moment: str = "files") -> None:
        if moment not in FAULT_MOMENTS:
            raise ValueError(f"{FAULT_ENV}: moment {moment!r} is not one of {', '.join(FAULT_MOMENTS)}")
        self.save, self.moment = save, moment

    @classmethod
    def parse(cls, value: str) -> "SaveFault":
        """``N`` or ``N:MOMENT``."""
        number, _, moment = value.partition(":")
        if not number.isdigit():
            raise ValueError(f"{FAULT_ENV}={value!r}: expected N or N:MOMENT (N a save's number, from 1)")
        return cls(int(number), moment or "files")

    def __call__(self, moment: str, *, save: int, storage: Any = None, **_: Any) -> None:
        if save != self.save:
            return
        if self.moment == "enospc" and moment == "files":
            storage.fs = _FaultyFileSystem(storage.fs)
        elif moment == self.moment:
            os._exit(137)


def install_from_env(environ: Optional[Mapping[str, str]] = None) -> None:
    """Install the fault ``FAULT_ENV`` names, if it is set (a test rank calls this before its run)."""
    value = (os.environ if environ is None else environ).get(FAULT_ENV)
    if value:
        hooks.install(SaveFault.parse(value))


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
