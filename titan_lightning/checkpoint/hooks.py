"""The one instrumentation point of a save, for tests: ``CheckpointWriter.save`` calls
``at(moment, save=N, ...)`` at fixed moments of its N-th save (counted per writer, from 1):

    "begin"    the ``.partial`` folder made (every rank agreed on it)
    "files"    every rank's state gathered, the shards not yet written; ``storage`` is the DCP
               storage writer about to write them (its ``fs`` may be wrapped)
    "written"  the shards written (for an async save: in the background thread), before
               meta.pt (with the manifest) and the rename

``at`` does nothing unless a hook was installed; nothing in titan_lightning installs one.
``titan_lightning.testing.faults`` does, in test ranks: a rank that dies at a moment, a full disk.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

MOMENTS = ("begin", "files", "written")

_hook: Optional[Callable[..., None]] = None


def install(hook: Optional[Callable[..., None]]) -> None:
    """Call ``hook(moment, save=N, **context)`` at each moment of every save from now on; None removes it."""
    global _hook
    _hook = hook


def at(moment: str, **context: Any) -> None:
    if _hook is not None:
        _hook(moment, **context)
