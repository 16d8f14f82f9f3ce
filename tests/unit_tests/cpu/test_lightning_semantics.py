"""A LightningModule of one's own sees Lightning's semantics under TitanStrategy, as under
ModelParallelStrategy: what it logs under gradient accumulation (each microbatch; the step's last
value reaches the logger; a torchmetrics Metric and positional ``self.log`` options included; a
titan_lightning module, one with a ``job``, logs the step's mean: test_training_metrics.py,
test_pipeline.py), the exception types (and Lightning's words) of a bad checkpoint path, of sizes that
do not cover the world and of a module wrapped by the legacy FSDP, and Lightning's materialization of
a module built on the meta device. (Lightning's own unit tests of ModelParallelStrategy, import swapped:
``python tests/lightning_upstream/run.py --lightning CHECKOUT --file unit``.)"""

import csv
import warnings
from unittest import mock

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
    with pytest.raises(IsADirectoryError, match=r"notes exists and is a directory that is not a checkpoint") as saving:
        trainer.save_checkpoint(folder)
    with pytest.raises(ValueError, match=r"notes does not point to a valid checkpoint") as loading:
        _trainer().fit(LogsEachMicrobatch(), ckpt_path=folder)
    assert isinstance(saving.value, CheckpointError) and isinstance(loading.value, CheckpointError)
    assert (folder / "notes.txt").read_text() == "mine"


def test_sizes_that_do_not_cover_the_world_raise_lightnings_runtime_error_when_the_environment_is_set_up():
    """As ModelParallelStrategy: at setup_environment too (here no launcher checked them at Trainer
    construction: a cluster environment says the world size)."""
    strategy = TitanStrategy(data_parallel_size=2, tensor_parallel_size=3)
    strategy._setup_distributed = mock.Mock()
    strategy.cluster_environment = mock.Mock(world_size=mock.Mock(return_value=4), local_rank=mock.Mock(return_value=0))
    strategy.parallel_devices = [torch.device("cpu")] * 4
    with pytest.raises(RuntimeError, match=r"2 \* 3 = 6; the sizes multiplied should equal the world size 4"):
        strategy.setup_environment()
    strategy._setup_distributed.assert_not_called()


def test_a_module_wrapped_by_the_legacy_fsdp_is_refused_in_setup():
    """configure_model runs after setup_environment: setup itself looks for FSDP1 wrappers."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    class LegacyWrapper(FullyShardedDataParallel):
        def __init__(self, module):  # (the type alone: wrapping for real shards over a process group)
            nn.Module.__init__(self)
            self.module = module

    class WrapsWithFSDP1(LogsEachMicrobatch):
        def configure_model(self):
            self.net = LegacyWrapper(self.net)

    with pytest.raises(TypeError, match=r"FullyShardedDataParallel \(FSDP1\); TitanStrategy only supports the new "
                                        r"FSDP2 APIs"):
        _trainer().fit(WrapsWithFSDP1())


class NoResetParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 1))

    def forward(self, x):
        return x @ self.weight


def test_a_module_built_on_the_meta_device_is_materialized_as_lightning_does():
    """``trainer.init_module(empty_init=True)``: every tensor materialized on the device,
    ``reset_parameters`` run where a module has one, Lightning's warning naming those without."""
    class OnMeta(LogsEachMicrobatch):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 4), NoResetParameters())

    trainer = _trainer()
    with trainer.init_module(empty_init=True):
        model = OnMeta()
    assert model.net[0].weight.is_meta
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert any("`reset_parameters()` method for re-initialization: NoResetParameters" in str(w.message) for w in caught)
