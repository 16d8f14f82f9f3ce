"""Loss-masked training (``data.sft``) on any layout: the debug Llama cut small, fed batches whose rows
hold very different numbers of supervised tokens (3, 59, none, 11 of 64), so that a loss averaged per
microbatch or per rank would differ from the one-process run. Each rank returns, per step, the
logged loss and supervised token count and a fingerprint of every parameter's gradient after the step's normalization
(its norm and its dot product with a fixed random tensor). Run in-process for one rank, and on 2
ranks through titan_lightning.testing.spawn by test_sft_loss.py.
"""

import os
from typing import Optional

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from recipes.tests import features
from titan_lightning.config.lora import LoRAConfig
from titan_lightning.models.common.loss import IGNORE_INDEX
from titan_lightning.recipe import on_layout, with_cp
from titan_lightning.strategies import TitanStrategy

SEQ = 64
ROWS = 4  # the global batch
# Supervised label positions of each row of a global batch: [first, last).
SPANS = [(10, 13), (5, 64), (0, 0), (40, 51)]


def global_batch(step: int, vocab: int, spans=SPANS, change_last: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Random tokens; labels supervised on ``spans``. ``change_last``: rows whose last token (a
    target only, never an input) is replaced by another id."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=g)
    for row in change_last:
        tokens[row, -1] = (tokens[row, -1] + 1 + step) % vocab
    labels = torch.full((ROWS, SEQ), IGNORE_INDEX)
    for row, (first, last) in enumerate(spans):
        labels[row, first:last] = tokens[row, 1:][first:last]
    return {"input_ids": tokens[:, :-1], "labels": labels}


def _fingerprint(module: torch.nn.Module) -> dict[str, list[float]]:
    out = {}
    for name, p in module.named_parameters():
        grad = p.grad
        if grad is None:
            continue
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        probe = torch.randn(full.shape, generator=torch.Generator().manual_seed(len(name)), dtype=full.dtype)
        out[name] = [full.norm().item(), (full * probe).sum().item()]
    return out


def sft_run(rank: int = 0, world_size: int = 1, *, degrees: Optional[dict] = None, accumulate: int = 1,
            steps: int = 2, spans=None, change_last: tuple[int, ...] = (), pp_microbatches: int = 2,
            loss_chunks: Optional[int] = None, lora: Optional[dict] = None) -> dict:
    """Train ``steps`` steps on ``degrees`` (TitanStrategy keywords); the loss and gradient
    fingerprints of each step. ``lora``: ``job.lora``'s fields (adapters train, the base is frozen)."""
    degrees = dict(degrees or {})
    run = features.llama3_small()
    if degrees.get("cp", 1) > 1:
        run = with_cp(run, "allgather", **degrees)
    elif degrees:
        run = on_layout(run, **degrees)
    job = run.job
    job.training.max_grad_norm = None
    job.training.loss_chunks = loss_chunks
    if lora is not None:
        job.lora = LoRAConfig(**lora)
    if degrees.get("pp", 1) > 1:
        job.parallelism.pp_microbatches = pp_microbatches
    spans = [tuple(s) for s in spans] if spans is not None else SPANS
    pp, cp, tp = degrees.get("pp", 1), degrees.get("cp", 1), degrees.get("tp", 1)
    dp = world_size // (pp * cp * tp)
    dp_rank = (rank // (cp * tp)) % dp
    rows = ROWS // dp // accumulate
    batches = []
    for step in range(steps):
        full = global_batch(step, job.model.vocab_size, spans, tuple(change_last))
        mine = {k: v[dp_rank * ROWS // dp:(dp_rank + 1) * ROWS // dp] for k, v in full.items()}
        batches += [{k: v[m * rows:(m + 1) * rows] for k, v in mine.items()} for m in range(accumulate)]

    recorded: list[dict] = []

    class Module(type(run.module)):
        loss_over_step_tokens = True

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            recorded.append({"grads": _fingerprint(self.model)})

    module = Module(job)
    strategy = TitanStrategy() if world_size > 1 else "auto"
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=steps,
                        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, use_distributed_sampler=False, default_root_dir=os.environ.get("TMPDIR", "/tmp"))

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if "train/loss" in trainer.callback_metrics and len(recorded) > len(losses):
                losses.append(trainer.callback_metrics["train/loss"].item())
                tokens.append(trainer.callback_metrics["train/supervised_tokens"].item())

    losses: list[float] = []
    tokens: list[float] = []
    trainer.callbacks.append(Losses())
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    for entry, loss, count in zip(recorded, losses, tokens, strict=True):
        entry["loss"], entry["supervised_tokens"] = loss, count
    return {"steps": recorded}
