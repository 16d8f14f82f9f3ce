"""A LightningModule that knows nothing of titan_lightning, and recipes that train it.

Imported by test_strategies.py and, through PYTHONPATH, by its worker processes.
"""

import lightning as L
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

from titan_lightning.recipe import Run
from titan_lightning.strategies import FSDP2Strategy, TitanStrategy


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class UserModule(L.LightningModule):
    def __init__(self, batch_size: int, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_size = batch_size
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(4))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss, sync_dist=True)
        self.log("fsdp_units", float(sum(isinstance(m, FSDPModule) for m in self.modules())))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
        return DataLoader(data, batch_size=self.batch_size, shuffle=False)


_TRAINER = dict(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, accelerator="cpu")


def single() -> Run:
    """One process. Through TitanStrategy (which applies nothing at world size 1) so that
    Lightning shuffles with the same DistributedSampler permutation as the 2-rank runs."""
    return Run(module=UserModule(batch_size=8), trainer=dict(_TRAINER, strategy=TitanStrategy(dp_shard=1)))


def fsdp2() -> Run:
    """Two ranks, each half of the single process's batch."""
    return Run(module=UserModule(batch_size=4), trainer=dict(_TRAINER, strategy=FSDP2Strategy()))


def titan_dp_shard2() -> Run:
    return Run(module=UserModule(batch_size=4), trainer=dict(_TRAINER, strategy=TitanStrategy(dp_shard=2)))


def titan_tp2() -> Run:
    """Asks for TP on a module that declares no plan."""
    return Run(module=UserModule(batch_size=8), trainer=dict(_TRAINER, strategy=TitanStrategy(dp_shard=1, tp=2)))
