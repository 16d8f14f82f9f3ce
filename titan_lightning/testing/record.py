"""A callback that records what each optimizer step produced."""

import time
from typing import Any

import lightning as L

from titan_lightning.steps import ends_optimizer_step


class RecordSteps(L.Callback):
    """Step, loss (``train/loss`` as logged, so synced across ranks), grad norm and wall time per
    optimizer step (``step_times[i]``: seconds since the previous step ended, or since fit started)."""

    def __init__(self) -> None:
        self._last = None
        self.step_times: list[float] = []
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.grad_norms: list[float | None] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not ends_optimizer_step(trainer, batch_idx):
            return
        now = time.perf_counter()
        self.step_times.append(now - (self._last if self._last is not None else now))
        self._last = now
        self.steps.append(trainer.global_step)
        self.losses.append(trainer.callback_metrics["train/loss"].item())
        norm = getattr(pl_module, "last_grad_norm", None)
        self.grad_norms.append(None if norm is None else norm.item())


class StopAtStep(L.Callback):
    """End fit after optimizer step ``step`` as if the job were preempted there (the schedule
    still runs to ``trainer.max_steps``): a save-then-resume test's first half."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class SignalAtStep(L.Callback):
    """Send ``signum`` to this process after optimizer step ``step`` on ``rank`` only (a preemption
    that reaches one rank; the others must learn it)."""

    def __init__(self, step: int, rank: int, signum: int) -> None:
        self.step, self.rank, self.signum = step, rank, signum

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        import os

        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)
