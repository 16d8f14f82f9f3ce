"""Seeds and deterministic mode, torchtitan's rule: ranks of one SPMD program share a seed,
pipeline stages (different programs) get distinct ones.

A deterministic run turns on deterministic algorithms (cuBLAS workspace, cuDNN) and fixes
the CPU thread count, since a reduction split over another number of threads adds in
another order. With a fixed seed, two such runs are bitwise identical.
"""

import os
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

CUBLAS_WORKSPACE = ":4096:8"


@dataclass(frozen=True)
class DeterminismState:
    """What ``set_determinism`` changed, so ``restore`` can put it back (pytest runs many trainers)."""

    threads: int
    deterministic_algorithms: bool
    warn_only: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool

    def restore(self) -> None:
        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(self.deterministic_algorithms, warn_only=self.warn_only)
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark


def stage_seed(seed: int, *, pp_rank: int = 0, pp: int = 1) -> int:
    """The seed of one rank: the run's seed, offset by the pipeline stage when pp > 1."""
    return seed + pp_rank if pp > 1 else seed


def set_determinism(
    seed: int,
    *,
    deterministic: bool,
    device_type: str,
    pp_rank: int = 0,
    pp: int = 1,
    cpu_threads: Optional[int] = None,
) -> DeterminismState:
    """Seed python, numpy and torch (all devices) with ``stage_seed``; in deterministic mode also
    deterministic algorithms and, on CPU, ``cpu_threads`` threads (1 when None).

    Returns the previous state; call its ``restore()`` when the run ends.
    """
    previous = DeterminismState(
        threads=torch.get_num_threads(),
        deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
        warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn_deterministic=torch.backends.cudnn.deterministic,
        cudnn_benchmark=torch.backends.cudnn.benchmark,
    )
    value = stage_seed(seed, pp_rank=pp_rank, pp=pp)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)  # also seeds every CUDA device
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    threads = cpu_threads if cpu_threads is not None else (1 if deterministic else None)
    if device_type == "cpu" and threads is not None:
        torch.set_num_threads(threads)
    return previous

