"""Per-step training metrics that are not the model's business: LR and throughput."""

import time
from typing import Any, Optional

import lightning as L
import torch


class TrainingMetrics(L.Callback):
    """Logs ``train/lr`` and ``train/tokens_per_s`` (tokens one device trains per second).

    Step time runs from the start of the first microbatch of an optimizer step to the
    end of its last one, so gradient accumulation is counted once per step.
    """

    def __init__(self) -> None:
        self._step_start: Optional[float] = None
        self._tokens = 0
        self._lr = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._step_start is None:
            _synchronize(pl_module.device)
            self._step_start = time.perf_counter()
            self._tokens = 0
            # The scheduler steps before on_train_batch_end; read the LR this step used now.
            self._lr = trainer.optimizers[0].param_groups[0]["lr"]
        self._tokens += batch["input_ids"].numel()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        _synchronize(pl_module.device)
        elapsed = time.perf_counter() - self._step_start
        self._step_start = None
        pl_module.log("train/tokens_per_s", self._tokens / elapsed, prog_bar=True)
        pl_module.log("train/lr", self._lr)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
