"""A LightningModule that knows nothing of titan_lightning, and recipes that train it.

Imported by test_strategies.py and, through PYTHONPATH, by its worker processes.
"""

import lightning as L
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

from titan_lightning.parallel.pipeline import PipelinePlan
from titan_lightning.recipe import Run
from titan_lightning.strategies import FSDP2Strategy, PipelineParallelStrategy, TitanStrategy


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


# A user's module for pipeline parallelism: the network is one attribute (`net`) whose blocks
# sit in a ModuleDict and whose forward skips a None embedding or head, as PipelinePlan asks.
class Net(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleDict({str(i): Block(dim) for i in range(4)})
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            h = block(h)
        return self.head(h) if self.head is not None else h


class PipelineUserModule(UserModule):
    """The same training_step as UserModule; only the network's home differs."""

    pipeline_plan = PipelinePlan(model="net", layers="blocks", first=("embed",), last=("head",))

    def __init__(self, batch_size: int) -> None:
        L.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.batch_size = batch_size
        self.net = Net()

    def forward(self, x):
        return self.net(x)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def val_dataloader(self):
        return self.train_dataloader()


# Lightning's own clipping: under PP the norm must span both stages to match one process.
_PP_TRAINER = dict(_TRAINER, limit_val_batches=2, val_check_interval=2, num_sanity_val_steps=1, gradient_clip_val=0.1)


def pipeline_single() -> Run:
    return Run(module=PipelineUserModule(batch_size=8), trainer=dict(_PP_TRAINER, strategy=TitanStrategy(dp_shard=1)))


def pipeline_pp2() -> Run:
    """Two stages (embed + 2 blocks | 2 blocks + head), 1F1B over 2 microbatches of 4."""
    strategy = PipelineParallelStrategy(pp_microbatches=2)
    return Run(module=PipelineUserModule(batch_size=8), trainer=dict(_PP_TRAINER, strategy=strategy))


def pipeline_no_plan() -> Run:
    """pp=2 on a module that declares no pipeline plan."""
    return Run(module=UserModule(batch_size=8), trainer=dict(_TRAINER, strategy=TitanStrategy(dp_shard=1, pp=2, pp_microbatches=2)))


class ComputeDtype(L.Callback):
    """Logs ``probe/bf16`` = 1.0 when this rank's first linear layer computed in bf16 in the step."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.dtypes = []
        first = next(m for m in pl_module.model.modules() if isinstance(m, nn.Linear))
        first.register_forward_hook(lambda module, args, out: self.dtypes.append(out.dtype))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("probe/bf16", float(bool(self.dtypes) and all(d == torch.bfloat16 for d in self.dtypes)))


def llama3_pp2_bf16() -> Run:
    """The Llama 3 debug model cut small (bf16 matmuls are slow on CPU) on 2 pipeline stages, no
    FSDP, bf16 compute over fp32 parameters."""
    from titan_lightning.recipe import on_layout
    from recipes.tests.features import llama3_small

    run = on_layout(llama3_small(), pp=2, dp_shard=1)
    run.job.parallelism.pp_microbatches = 2
    run.job.training.mixed_precision_param = "bfloat16"
    run.trainer.update(max_steps=1, callbacks=[ComputeDtype()], limit_val_batches=0)
    return run
