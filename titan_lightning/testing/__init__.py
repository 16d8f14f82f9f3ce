"""Test helpers: real multi-process runs of a ``titan-lightning`` command (gloo on CPU) that never hang.

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
    "LaunchError",
    "LaunchFailed",
    "LaunchResult",
    "LaunchTimeout",
    "free_port",
    "launch",
    "rank_env",
    "run_single",
]
