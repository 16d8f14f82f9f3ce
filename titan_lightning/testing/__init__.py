"""Test helpers: real multi-process runs of a ``titan-lightning`` command (gloo on CPU) that never hang.

``hash_model`` / ``hash_gradient`` fingerprint a model (hashing.py).
``launch(argv, world_size, out_dir=..., timeout=...)`` starts one worker process per rank
(``titan_lightning.testing.worker``) and returns each rank's per-step losses and grad norms.
"""

from titan_lightning.testing.launch import (
    LaunchError,
    LaunchFailed,
    LaunchResult,
    LaunchTimeout,
    free_port,
    launch,
    rank_env,
    run_single,
)

__all__ = [
    "hash_gradient",
    "hash_model",
    "LaunchError",
    "LaunchFailed",
    "LaunchResult",
    "LaunchTimeout",
    "free_port",
    "launch",
    "rank_env",
    "run_single",
]


def __getattr__(name: str):
    # Lazy: importing the launcher must not import torch (tests/conftest.py relies on it).
    if name in ("hash_model", "hash_gradient"):
        from titan_lightning.testing import hashing  # (start-up time: hashing imports torch)

        return getattr(hashing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
