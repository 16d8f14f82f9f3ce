"""What a LightningModule logs under TitanStrategy is what Lightning logs: a module of one's own
under gradient accumulation logs each microbatch (the step's last value reaches the logger), a
torchmetrics Metric and positional ``self.log`` options included. (A titan_lightning module, one
with a ``job``, logs the step's mean: test_training_metrics.py, test_pipeline.py.)"""

import csv

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from titan_lightning.strategies import TitanStrategy
from titan_lightning.strategies.logs import record_logs


class LogsEachMicrobatch(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.seen = MeanMetric()

    def training_step(self, batch, batch_idx):
        self.seen(torch.tensor(float(batch_idx)))
        self.log("seen", self.seen)
        self.log("batch_idx", float(batch_idx), True)  # prog_bar, positionally
        return self.net(batch[0]).pow(2).mean()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _logged(strategy, folder) -> list[dict]:
    L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=2,
              log_every_n_steps=1, logger=CSVLogger(folder, name="", version=""), enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(LogsEachMicrobatch())
    return list(csv.DictReader(open(folder / "metrics.csv")))


def test_a_module_of_ones_own_under_accumulation_logs_what_lightning_logs(tmp_path):
    titan = _logged(TitanStrategy(), tmp_path / "titan")
    assert titan == _logged("auto", tmp_path / "lightning")
    assert [float(row["batch_idx"]) for row in titan] == [1.0, 3.0, 5.0, 7.0]  # each step's last microbatch


def test_recorded_logs_keep_positional_options_by_name():
    records: list = []
    record_logs(records)("loss", 1.0, True, False, reduce_fx="max")
    assert records == [("loss", 1.0, {"prog_bar": True, "logger": False, "reduce_fx": "max"})]
