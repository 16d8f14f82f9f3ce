"""LightningModules in the styles people write without knowing titan_lightning, and recipes that
train each one on one process or several (imported by test_dropin.py and, through PYTHONPATH,
by its rank processes).

- ``SubmoduleModule``: the network is an attribute and training_step calls it directly
  (``self.model(x)``), never ``self(x)``.
- ``TwoPartModule``: an encoder and a decoder called one after the other from training_step,
  with a parameter of the LightningModule itself in between.
- ``MPSModule``: written for Lightning's ModelParallelStrategy: configure_model applies TP
  and FSDP2 itself through ``self.device_mesh["tensor_parallel"]`` / ``["data_parallel"]``,
  training_step and backward enter ``loss_parallel()`` themselves.

Every recipe records ``last_grad_norm`` (the global gradient norm, what the test compares) with
a callback, so the modules themselves stay free of this project.
"""

import os
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from titan_lightning.parallel.grad_norm import global_grad_norm
from titan_lightning.recipe import Run
from titan_lightning.strategies import FSDP2Strategy, TitanStrategy

# 3 optimizer steps per epoch at a global batch of 8: the full checkpoint is saved at an epoch's end.
SAMPLES = 24


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.linear = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


class Net(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def regression_data(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


class SubmoduleModule(L.LightningModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_size = batch_size
        self.model = Net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.model(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return regression_data(self.batch_size)

    def val_dataloader(self):
        return regression_data(self.batch_size)


class ManualModule(SubmoduleModule):
    """Manual optimization (GAN-style code): backward and step inside training_step."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(batch_size)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.last_grad_norm = global_grad_norm([p.grad for p in self.parameters() if p.grad is not None])
        optimizer.step()
        self.log("train/loss", loss, sync_dist=True)


class TwoPartModule(SubmoduleModule):
    def __init__(self, batch_size: int) -> None:
        L.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.batch_size = batch_size
        self.encoder = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32))
        self.scale = nn.Parameter(torch.ones(32))  # the LightningModule's own
        self.decoder = Net(dim=32)
        self.decoder.embed = nn.Linear(32, 32)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.encoder(x) * self.scale
        loss = F.mse_loss(self.decoder(h), y)
        self.log("train/loss", loss, sync_dist=True)
        return {"loss": loss}


# -- a small Llama in the style of Lightning's tensor-parallel example ------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, n_heads), FeedForward(dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, n_heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads) for _ in range(depth))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model: Transformer, device_mesh) -> Transformer:
    """TP, then FSDP2, through the mesh dims ModelParallelStrategy names."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_mesh, dp_mesh = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        })
        for block in model.layers:
            parallelize_module(block, tp_mesh, {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            })
            block.attention.n_heads //= tp_mesh.size()
    if dp_mesh.size() > 1:
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


class MPSModule(L.LightningModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_size = batch_size
        self.model = Transformer()

    def configure_model(self):
        parallelize(self.model, self.device_mesh)

    def training_step(self, batch):
        from torch.distributed.tensor.parallel import loss_parallel

        (tokens,) = batch
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        output = self.model(inputs)
        with loss_parallel():
            loss = F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))
        self.log("train/loss", loss.full_tensor() if hasattr(loss, "full_tensor") else loss, sync_dist=True)
        return loss

    def backward(self, *args, **kwargs):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            super().backward(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=True)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(2)
        return DataLoader(TensorDataset(torch.randint(64, (SAMPLES, 17), generator=g)), batch_size=self.batch_size)


# -- recipes -----------------------------------------------------------------------------------


class GradNorm(L.Callback):
    """Sets ``pl_module.last_grad_norm`` (the worker records it) before each optimizer step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        pl_module.last_grad_norm = global_grad_norm([p.grad for p in pl_module.parameters() if p.grad is not None])


STEPS = 5


def _run(module: L.LightningModule, strategy, *, ckpt_path: Optional[str] = None, validate: bool = False) -> Run:
    """STEPS steps; with $STYLES_CHECKPOINTS set, Lightning's ModelCheckpoint saves there at each
    epoch's end (step 3); ``validate``: 2 validation batches at each epoch's end."""
    folder = os.environ.get("STYLES_CHECKPOINTS")
    callbacks = [GradNorm()]
    if folder:
        callbacks.append(ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1))
    trainer = dict(max_steps=STEPS, logger=False, enable_checkpointing=bool(folder), enable_progress_bar=False,
                   enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0, limit_val_batches=2 if validate else 0,
                   callbacks=callbacks, strategy=strategy)
    return Run(module=module, trainer=trainer, ckpt_path=ckpt_path)


# One process through TitanStrategy (which applies nothing at world size 1), so that Lightning
# feeds the same DistributedSampler order as the multi-rank runs.
def submodule_single() -> Run:
    return _run(SubmoduleModule(batch_size=8), TitanStrategy(dp_shard=1, save_distributed_checkpoint=False),
                validate=True)


def submodule_titan_fsdp2() -> Run:
    return _run(SubmoduleModule(batch_size=4), TitanStrategy(dp_shard=2), validate=True)


def submodule_fsdp2_full_checkpoint() -> Run:
    """FSDP2Strategy with ModelParallelStrategy's ``save_distributed_checkpoint=False``: one file."""
    return _run(SubmoduleModule(batch_size=4), FSDP2Strategy(save_distributed_checkpoint=False), validate=True)


def submodule_resume(world_size: int = 2) -> Run:
    """Resume from the checkpoint in $STYLES_RESUME and train to STEPS."""
    return _run(SubmoduleModule(batch_size=8 // world_size), TitanStrategy(dp_shard=world_size),
                ckpt_path=os.environ["STYLES_RESUME"])


def submodule_resume_single() -> Run:
    return submodule_resume(world_size=1)


def submodule_ddp() -> Run:
    return _run(SubmoduleModule(batch_size=4), TitanStrategy(dp_replicate=2, dp_shard=1), validate=True)


def two_part_single() -> Run:
    return _run(TwoPartModule(batch_size=8), TitanStrategy(dp_shard=1))


def two_part_titan_fsdp2() -> Run:
    return _run(TwoPartModule(batch_size=4), TitanStrategy(dp_shard=2))


def mps_single() -> Run:
    return _run(MPSModule(batch_size=8), TitanStrategy(data_parallel_size=1, tensor_parallel_size=1))


def mps_dp2_tp2() -> Run:
    """The only change from ModelParallelStrategy code: the class name."""
    return _run(MPSModule(batch_size=4), TitanStrategy(data_parallel_size=2, tensor_parallel_size=2))



def manual_fsdp2() -> Run:
    return _run(ManualModule(batch_size=4), TitanStrategy(dp_shard=2), validate=True)


def submodule_accumulate_fsdp2() -> Run:
    """Two microbatches of 2 per rank and optimizer step: the same steps as one batch of 8."""
    run = _run(SubmoduleModule(batch_size=2), TitanStrategy(dp_shard=2))
    run.trainer["accumulate_grad_batches"] = 2
    return run
