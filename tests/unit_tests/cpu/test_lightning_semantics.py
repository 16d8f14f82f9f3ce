"""A LightningModule of one's own sees Lightning's semantics under TitanStrategy, as under
ModelParallelStrategy: what it logs under gradient accumulation (each microbatch; the step's last
value reaches the logger; a torchmetrics Metric and positional ``self.log`` options included; a
titan_lightning module, one with a ``job``, logs the step's mean: test_training_metrics.py,
test_pipeline.py), and the exception types a bad checkpoint path raises."""

import csv

import pytest

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from titan_lightning.checkpoint import CheckpointError
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


def _trainer(**strategy) -> L.Trainer:
    return L.Trainer(strategy=TitanStrategy(**strategy), accelerator="cpu", devices=1, max_steps=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def test_checkpoint_paths_that_are_no_checkpoint_raise_model_parallel_strategys_types(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    trainer = _trainer(save_distributed_checkpoint=False)
    trainer.fit(LogsEachMicrobatch())
    with pytest.raises(IsADirectoryError, match=r"notes is a folder that is not a checkpoint") as saving:
        trainer.save_checkpoint(folder)
    with pytest.raises(ValueError, match=r"notes is not a complete checkpoint") as loading:
        _trainer().fit(LogsEachMicrobatch(), ckpt_path=folder)
    assert isinstance(saving.value, CheckpointError) and isinstance(loading.value, CheckpointError)
    assert (folder / "notes.txt").read_text() == "mine"
