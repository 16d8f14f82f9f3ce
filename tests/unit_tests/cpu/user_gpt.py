"""A user's small GPT, LitGPT-style, written without knowing titan_lightning, and recipes that train it.

What tensor parallelism must cope with here: a config dataclass shared by every block and
read for the reshapes (``config.n_head``, ``config.n_query_groups``); a fused qkv projection
whose rows are grouped per query group ([n_query_groups, q_per_kv + 2, head_size]); a fused
[gate; up] MLP projection. Imported by test_user_tp.py and, through PYTHONPATH, by its workers.
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
    n_query_groups: int = 2
    head_size: int = 16
    intermediate_size: int = 96
    block_size: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        # q, k, v rows grouped per query group: [n_query_groups, q_per_kv + 2, head_size]
        self.attn = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_query_groups) * config.head_size)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.config
        q_per_kv = c.n_head // c.n_query_groups
        qkv = self.attn(x).view(B, T, c.n_query_groups, q_per_kv + 2, c.head_size)
        qkv = qkv.permute(0, 2, 3, 1, 4)  # [B, groups, q_per_kv + 2, T, hs]
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        q = q.reshape(B, c.n_head, T, c.head_size)
        k = k.expand(-1, -1, q_per_kv, -1, -1).reshape(B, c.n_head, T, c.head_size)
        v = v.expand(-1, -1, q_per_kv, -1, -1).reshape(B, c.n_head, T, c.head_size)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, c.n_head * c.head_size))


class MLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.intermediate_size)  # rows [gate; up]
        self.proj = nn.Linear(config.intermediate_size, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

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
    tp_plan = {
        "model.wte": "embedding",
        "model.h.*.norm_1": "norm",
        "model.h.*.attn": "prepare_block_input",
        "model.h.*.attn.attn": "colwise",
        "model.h.*.attn.proj": "rowwise",
        "model.h.*.norm_2": "norm",
        "model.h.*.mlp": "prepare_block_input",
        "model.h.*.mlp.fc": "colwise_fused:2",
        "model.h.*.mlp.proj": "rowwise",
        "model.ln_f": "norm",
        "model.lm_head": "output",
    }

    def __init__(self, config: Optional[Config] = None, batch_size: int = 4, samples: int = 64) -> None:
        super().__init__()
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
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None])
        self.last_grad_norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm

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


def _run(strategy: TitanStrategy, batch_size: int = 4) -> Run:
    folder, resume = os.environ.get("USER_GPT_CHECKPOINTS"), os.environ.get("USER_GPT_RESUME")
    module = GPTModule(batch_size=batch_size, samples=EPOCH_SAMPLES if folder or resume else 64)
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

