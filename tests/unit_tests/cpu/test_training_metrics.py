"""TrainingMetrics measures and logs only the steps whose metrics reach the loggers."""

import csv

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

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


def test_counts_every_microbatch_of_a_measured_step(tmp_path):
    # 2 microbatches of 2 x 8 tokens per optimizer step; logged every step.
    rows, metrics = _fit(tmp_path, log_every_n_steps=1, accumulate_grad_batches=2)
    rates = [float(r["train/tokens_per_s"]) for r in rows if r.get("train/tokens_per_s")]
    assert len(rates) == 6
    assert metrics._tokens == 2 * 2 * 8
