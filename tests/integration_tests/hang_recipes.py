"""Test-only recipes for test_hung_rank.py: the debug model, small, where one rank hangs inside a step."""

import time

import lightning as L

from recipes.llama3 import fsdp2
from titan_lightning.recipe import Run


class SleepInStep(L.Callback):
    """Rank ``rank`` sleeps ``seconds`` between the forward and the backward of optimizer step
    ``step`` + 1: alive, beating, and not in the collective its peers wait in."""

    def __init__(self, *, rank: int, step: int, seconds: float) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            time.sleep(self.seconds)


def fsdp2_rank1_hangs() -> Run:
    run = fsdp2()
    model, training = run.job.model, run.job.training
    model.dim, model.n_layers, model.n_heads, model.n_kv_heads, training.seq_len = 64, 2, 4, 4, 64
    run.job.comm.train_timeout_s = 15  # (5 s: a rank starved on a loaded 2-core CI machine was late past it)
    run.trainer.update(max_steps=6, limit_val_batches=0, enable_checkpointing=False)
    run.trainer["callbacks"] = [*run.trainer.get("callbacks", []), SleepInStep(rank=1, step=2, seconds=120)]
    return run
