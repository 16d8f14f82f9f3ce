"""A callback that records what each optimizer step produced."""

from typing import Any

import lightning as L


class RecordSteps(L.Callback):
    """Step, loss (``train/loss`` as logged, so synced across ranks) and grad norm per optimizer step."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.grad_norms: list[float | None] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        self.steps.append(trainer.global_step)
        self.losses.append(trainer.callback_metrics["train/loss"].item())
        norm = getattr(pl_module, "last_grad_norm", None)
        self.grad_norms.append(None if norm is None else norm.item())
