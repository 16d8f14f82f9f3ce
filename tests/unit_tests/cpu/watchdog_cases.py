"""Rank functions for test_watchdog.py (run by titan_lightning.testing.spawn on gloo ranks)."""

import os
import threading
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from titan_lightning.parallel.watchdog import Watchdog

QUICK = dict(interval_s=0.2, answer_s=5.0)


def sleepy_rank(rank: int, world_size: int, dump_dir: str, timeout_s: float, sleep_s: float) -> str:
    """Both ranks meet in one all-reduce; then rank 1 sleeps ``sleep_s`` before the next (a rank
    stuck in its step) while rank 0 waits in it."""
    watchdog = Watchdog(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        init_timeout_s=timeout_s, train_timeout_s=timeout_s, dump_dir=Path(dump_dir), **QUICK)
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        time.sleep(sleep_s)
    dist.all_reduce(torch.ones(1))
    watchdog.stop()
    return "finished"


def _threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive())


class _ThreadsInStep(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.names = _threads()


def threads_after_fit(rank: int, world_size: int, root: str) -> dict[str, list[str]]:
    """A 2-step fit under TitanStrategy: the names of the threads alive in a step, and once fit has returned."""
    from lightning_styles import SubmoduleModule

    from titan_lightning import TitanStrategy

    seen = _ThreadsInStep()
    trainer = L.Trainer(strategy=TitanStrategy(dp_shard=world_size), devices=world_size, accelerator="cpu",
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=root, callbacks=[seen])
    trainer.fit(SubmoduleModule(batch_size=4))
    after = _threads()
    if not dist.is_initialized():  # (teardown destroyed the default group: spawn's closing barrier needs one)
        dist.init_process_group("gloo", init_method=f"file://{root}/rejoin", rank=rank, world_size=world_size)
    return {"in_step": seen.names, "after_fit": after}
