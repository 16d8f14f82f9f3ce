"""TrainingMetrics logs on the steps whose metrics reach the loggers, the throughput of every step since the
last logged one, without waiting for the device."""

import csv

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from titan_lightning.callbacks import metrics as metrics_module
from titan_lightning.callbacks.metrics import TrainingMetrics


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 4)

    def training_step(self, batch, batch_idx):
        loss = self.embedding(batch["input_ids"]).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader([{"input_ids": torch.arange(8)} for _ in range(64)], batch_size=2)


def _fit(tmp_path, **trainer):
    metrics = TrainingMetrics()
    logger = CSVLogger(tmp_path, name="csv", version="")
    L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=logger, callbacks=[metrics],
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              **trainer).fit(_Tiny())
    return list(csv.DictReader(open(tmp_path / "csv" / "metrics.csv"))), metrics


def test_logs_throughput_on_logging_steps_only(tmp_path):
    rows, _ = _fit(tmp_path, log_every_n_steps=3)
    measured = [int(r["step"]) for r in rows if r.get("train/tokens_per_s")]
    assert measured == [2, 5]  # optimizer steps 3 and 6 (the CSV counts from 0)
    assert all(float(r["train/tokens_per_s"]) > 0 for r in rows if r.get("train/tokens_per_s"))
    assert [int(r["step"]) for r in rows if r.get("train/lr")] == measured


class _Clock:
    """A host clock that advances one second per reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_tokens_per_s_covers_every_microbatch_since_the_last_log(tmp_path, monkeypatch):
    # 2 microbatches of 2 x 8 tokens per optimizer step, 6 steps, logged every 3: each logged rate is
    # the 3 steps' 96 tokens over the clock's seconds between the two logged ends (validation left out).
    clock = _Clock()
    monkeypatch.setattr(metrics_module, "clock", clock)
    rows, _ = _fit(tmp_path, log_every_n_steps=3, accumulate_grad_batches=2)
    rates = [float(r["train/tokens_per_s"]) for r in rows if r.get("train/tokens_per_s")]
    # Readings: the first step's start (1), the ends of steps 3 (2) and 6 (3); no validation.
    assert rates == pytest.approx([3 * 2 * 2 * 8 / 1.0, 3 * 2 * 2 * 8 / 1.0], rel=1e-6)


def test_validation_time_is_left_out(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(metrics_module, "clock", clock)
    module = _Tiny()
    module.validation_step = lambda batch, batch_idx: None
    module.val_dataloader = lambda: DataLoader([{"input_ids": torch.arange(8)} for _ in range(2)], batch_size=2)
    logger = CSVLogger(tmp_path, name="csv", version="")
    L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=logger, callbacks=[TrainingMetrics()],
              log_every_n_steps=2, val_check_interval=1, num_sanity_val_steps=0, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(module)
    rows = list(csv.DictReader(open(tmp_path / "csv" / "metrics.csv")))
    rates = [float(r["train/tokens_per_s"]) for r in rows if r.get("train/tokens_per_s")]
    # Readings: start (1), validation after step 1 (2, 3), end of step 2 (4): 2 x 16 tokens over
    # 3 - 1 seconds; validation after step 2 (5, 6), after step 3 (7, 8), end of step 4 (9): 32 / (9 - 4 - 2).
    assert rates == pytest.approx([32 / 2.0, 32 / 3.0], rel=1e-6)  # (logged as float32)


def test_counts_every_microbatch_of_a_measured_step(tmp_path):
    # 2 microbatches of 2 x 8 tokens per optimizer step; logged every step.
    rows, metrics = _fit(tmp_path, log_every_n_steps=1, accumulate_grad_batches=2)
    rates = [float(r["train/tokens_per_s"]) for r in rows if r.get("train/tokens_per_s")]
    assert len(rates) == 6
    assert metrics._tokens == 0  # every logged step began the next interval
