"""A user's small GPT, LitGPT-style, written without knowing titan_lightning, and recipes that train it.

Laid out as LitGPT's ``litgpt/model.py`` (2026): one ``Config`` object shared by the GPT, every
block, attention and MLP, read for the reshapes (``config.n_head``, ``config.n_query_groups``);
a fused ``qkv`` projection whose rows are stacked [q (all heads); k (all query groups); v], split
by those sizes; LLaMA's MLP (``fc_1``, ``fc_2``, ``proj``). What tensor parallelism must cope with:
the shared config (a plan that shards only the MLP must leave the attention's counts alone) and
the stacked rows (``colwise_fused:3``; plain ``colwise`` would mix q and k rows, and is refused).
Imported by test_user_tp.py and, through PYTHONPATH, by its workers.
"""

import os
from dataclasses import dataclass
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from titan_lightning.recipe import Run
from titan_lightning.strategies import TitanStrategy


@dataclass
class Config:
    vocab_size: int = 128
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_query_groups: int = 4  # grouped-query attention when smaller (blocks of unequal size: no TP of qkv)
    head_size: int = 16
    intermediate_size: int = 96
    block_size: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.qkv = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_query_groups) * config.head_size)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        n_head, n_query_groups, head_size = self.config.n_head, self.config.n_query_groups, self.config.head_size
        q, k, v = self.qkv(x).split((n_head * head_size, n_query_groups * head_size, n_query_groups * head_size), -1)
        q = q.view(B, T, n_head, head_size).transpose(1, 2)
        k = k.view(B, T, n_query_groups, head_size).transpose(1, 2)
        v = v.view(B, T, n_query_groups, head_size).transpose(1, 2)
        if n_query_groups != n_head:  # each key/value head serves n_head // n_query_groups consecutive queries
            k = k.repeat_interleave(n_head // n_query_groups, dim=1)
            v = v.repeat_interleave(n_head // n_query_groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, head_size * n_head))


class MLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPTModule(L.LightningModule):
    # Megatron-style TP with sequence parallelism. No head counts are declared: the strategy
    # finds config.n_head and config.n_query_groups on the attention's config by their names.
    # The qkv rows are stacked [q; k; v]: 'colwise_fused:3' gives rank r [q_r; k_r; v_r].
    tp_plan = {
        "model.wte": "embedding",
        "model.h.*.norm_1": "norm",
        "model.h.*.attn": "prepare_block_input",
        "model.h.*.attn.qkv": "colwise_fused:3",
        "model.h.*.attn.proj": "rowwise",
        "model.h.*.norm_2": "norm",
        "model.h.*.mlp": "prepare_block_input",
        "model.h.*.mlp.fc_1": "colwise",
        "model.h.*.mlp.fc_2": "colwise",
        "model.h.*.mlp.proj": "rowwise",
        "model.ln_f": "norm",
        "model.lm_head": "output",
    }
    # Only the MLP sharded (what a grouped-query model can use: its qkv blocks are of unequal
    # size); the attention keeps every head, on the whole sequence (no sequence parallelism).
    MLP_PLAN = {"model.h.*.mlp.fc_1": "colwise", "model.h.*.mlp.fc_2": "colwise", "model.h.*.mlp.proj": "rowwise"}

    def __init__(self, config: Optional[Config] = None, batch_size: int = 4, samples: int = 64,
                 tp_plan: Optional[dict] = None) -> None:
        super().__init__()
        if tp_plan is not None:
            self.tp_plan = tp_plan
        torch.manual_seed(0)
        self.config = config or Config()
        self.batch_size, self.samples = batch_size, samples
        self.model = GPT(self.config)
        self.last_grad_norm = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("train/loss", loss)
        self.log("probe/n_head", float(self.config.n_head))  # what the reshapes read
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        # Whole gradients: a plan that shards some modules leaves the others' plain tensors.
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for p in self.parameters() if p.grad is not None]
        self.last_grad_norm = torch.nn.utils.get_total_norm(grads)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, self.config.vocab_size, (self.samples, self.config.block_size + 1), generator=g)
        return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=self.batch_size, shuffle=False)


_TRAINER = dict(max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, accelerator="cpu")
# A global batch of 4 sequences. With $USER_GPT_CHECKPOINTS set, an epoch is 3 steps and Lightning's
# ModelCheckpoint saves there after step 3, the epoch's last batch (not at the epoch's end: Lightning
# 2.6 resumes such a checkpoint in the old epoch, one batch too many); $USER_GPT_RESUME: the run
# resumes from that checkpoint (Run's ckpt_path), with the same 3-step epochs.
EPOCH_STEPS, EPOCH_SAMPLES = 3, 12


def _run(strategy: TitanStrategy, batch_size: int = 4, tp_plan: Optional[dict] = None) -> Run:
    folder, resume = os.environ.get("USER_GPT_CHECKPOINTS"), os.environ.get("USER_GPT_RESUME")
    module = GPTModule(batch_size=batch_size, samples=EPOCH_SAMPLES if folder or resume else 64, tp_plan=tp_plan)
    trainer = dict(_TRAINER, strategy=strategy)
    if folder:
        trainer.update(enable_checkpointing=True,
                       callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=EPOCH_STEPS, save_top_k=-1)])
    return Run(module=module, trainer=trainer, ckpt_path=resume)


def single() -> Run:
    """One process, through TitanStrategy (which applies nothing at world size 1)."""
    return _run(TitanStrategy(dp_shard=1))


def tp2() -> Run:
    """Two TP ranks, each on the whole batch; weights built on every rank with the same seed."""
    return _run(TitanStrategy(dp_shard=1, tp=2))


def tp2_mlp() -> Run:
    """Two TP ranks sharding only the MLP: the attention, which reads the same config, keeps every head."""
    return _run(TitanStrategy(dp_shard=1, tp=2, sequence_parallel=False), tp_plan=GPTModule.MLP_PLAN)
