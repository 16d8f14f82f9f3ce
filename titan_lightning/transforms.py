"""Transforms: swap parts of a run's configuration tree, then validate the whole run.

    run = apply_transforms(recipes.llama3.debugmodel(), [ContextParallelTransform(attention="ring", cp=2)])

``apply_transforms`` deep-copies the run, applies each transform in order, validates the
result (``validate_job``) and returns the copy; if anything fails the original is untouched.
"""

import copy
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from titan_lightning.config import ConfigError, validate_job
from titan_lightning.config.job import CP_ATTENTIONS
from titan_lightning.config.parallelism import CP_LOAD_BALANCERS
from titan_lightning.recipe import Run

Transform = Callable[[Run], None]
_UNSET = object()


@dataclass(frozen=True)
class ContextParallelTransform:
    """Give the model a context-parallel attention; optionally set ``parallelism.cp`` and the load balancer."""

    attention: str = "allgather"
    cp: Optional[int] = None
    load_balancer: object = _UNSET  # "headtail", None, ...; unset keeps the run's

    def __post_init__(self) -> None:
        if self.attention not in CP_ATTENTIONS:
            raise ValueError(
                f"ContextParallelTransform(attention={self.attention!r}): expected one of {', '.join(CP_ATTENTIONS)}"
            )
        if self.cp is not None and (not isinstance(self.cp, int) or self.cp < 2):
            raise ValueError(f"ContextParallelTransform(cp={self.cp!r}): expected an integer >= 2, or None")
        if self.load_balancer is not _UNSET and self.load_balancer not in (*CP_LOAD_BALANCERS, None):
            raise ValueError(
                f"ContextParallelTransform(load_balancer={self.load_balancer!r}): expected one of "
                f"{', '.join(CP_LOAD_BALANCERS)} or None"
            )

    def __call__(self, run: Run) -> None:
        job = run.job
        if job is None or not hasattr(job.model, "attention"):
            raise ConfigError(f"ContextParallelTransform needs a run whose model has `attention`; got {type(run.module).__name__}")
        job.model.attention = self.attention
        if self.cp is not None:
            job.parallelism.cp = self.cp
        if self.load_balancer is not _UNSET:
            job.parallelism.cp_load_balancer = self.load_balancer


def apply_transforms(run: Run, transforms: Sequence[Transform], *, world_size: Optional[int] = None) -> Run:
    """A validated copy of ``run`` with ``transforms`` applied in order.

    ``world_size`` defaults to the product of the degrees (``dp_shard=-1`` counted as 1).
    """
    result = copy.deepcopy(run)
    for transform in transforms:
        transform(result)
    job = result.job
    if job is not None:
        p = job.parallelism
        validate_job(job, world_size=world_size or p.fixed_degrees * max(p.dp_shard, 1),
                     max_steps=result.trainer.get("max_steps"))
    return result
