"""Rank functions for test_watchdog.py (run by titan_lightning.testing.spawn on gloo ranks)."""

import os
import sys
import threading
import time
from datetime import timedelta
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


def late_rank(rank: int, world_size: int, dump_dir: str, timeout_s: float, late_s: float, answer_after_s: float) -> str:
    """Both ranks meet in one all-reduce; then rank 1 comes to the next ``late_s`` after rank 0 (past
    rank 0's timeout), and its watchdog answers rank 0's request ``answer_after_s`` after seeing it (a
    loaded machine): by then it has entered the collective, which completes. Slow, not stuck."""
    watchdog = Watchdog(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        init_timeout_s=timeout_s, train_timeout_s=timeout_s, dump_dir=Path(dump_dir), **QUICK)
    if rank == 1:
        account = watchdog._account
        watchdog._account = lambda request: time.sleep(answer_after_s) or account(request)
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        time.sleep(late_s)
    dist.all_reduce(torch.ones(1))
    dist.all_reduce(torch.ones(1))  # (the run goes on past the incident)
    watchdog.stop()
    return "finished"


def stuck_after_async(rank: int, world_size: int, dump_dir: str, timeout_s: float, sleep_s: float) -> str:
    """Both ranks start an async all-reduce (FSDP's prefetch, a metric's reduction); rank 1 then
    gets stuck before waiting on it, rank 0 waits on it and goes on into the next all-reduce. Rank
    1's watchdog (the shorter timeout) sees its own unwaited all-reduce open first."""
    watchdog = Watchdog(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        init_timeout_s=timeout_s * (5 if rank == 0 else 1), train_timeout_s=timeout_s,
                        dump_dir=Path(dump_dir), **QUICK)
    from torch.distributed._functional_collectives import all_reduce as functional_all_reduce

    dist.all_reduce(torch.ones(1))
    total = functional_all_reduce(torch.ones(()), "sum", dist.group.WORLD)  # (its rank records it done on use)
    if rank == 1:
        time.sleep(sleep_s)
    float(total)
    dist.all_reduce(torch.ones(1))
    watchdog.stop()
    return "finished"


def mismatched_collective(rank: int, world_size: int, dump_dir: str, timeout_s: float) -> str:
    """Both ranks meet in one all-reduce; then rank 1 calls an all-reduce of its own while rank 0
    goes on to an all-gather: both wait, each in another collective under the same number. A
    progress bar's unended line is on each rank's screen."""
    watchdog = Watchdog(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        init_timeout_s=timeout_s, train_timeout_s=timeout_s, dump_dir=Path(dump_dir),
                        progress_bar=True, **QUICK)
    dist.all_reduce(torch.ones(4))
    sys.stderr.write("Epoch 0:  50%|#####     | 1/2")
    sys.stderr.flush()
    if rank == 1:
        dist.all_reduce(torch.ones(4))
    dist.all_gather([torch.zeros(4) for _ in range(world_size)], torch.ones(4))
    watchdog.stop()
    return "finished"


def _threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive())


class _Seen(L.Callback):
    """What a fit looks like from inside: the threads in a step, the watchdog's timeouts; rank 0
    works alone for ``solo_s`` after the first optimizer step (an evaluation, a large save)."""

    def __init__(self, solo_s: float = 0.0) -> None:
        self.solo_s, self.threads, self.watchdog = solo_s, [], None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.threads = _threads()
        watchdog = trainer.strategy.watchdog
        self.watchdog = [watchdog.init_timeout_s, watchdog.train_timeout_s, list(watchdog.fields)]
        if trainer.global_rank == 0 and trainer.global_step == 1:
            time.sleep(self.solo_s)


class _Failing(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        raise ValueError("the user's code fails on every rank")


def _trainer(world_size: int, root: str, callback: L.Callback, **strategy) -> L.Trainer:
    from titan_lightning import TitanStrategy

    return L.Trainer(strategy=TitanStrategy(dp_shard=world_size, **strategy), devices=world_size, accelerator="cpu",
                     max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, limit_val_batches=0, default_root_dir=root, callbacks=[callback])


def solo_rank(rank: int, world_size: int, root: str, timeout_s: float, solo_s: float) -> dict:
    """A plain LightningModule under ``TitanStrategy(timeout=timeout_s)`` whose rank 0 works alone
    for ``solo_s`` after the first step; then, in the same processes, a fit that fails on every
    rank. What each fit leaves behind: threads, the flight recorder's variable."""
    from lightning_styles import SubmoduleModule

    seen = _Seen(solo_s)
    trainer = _trainer(world_size, root, seen, timeout=timedelta(seconds=timeout_s))
    trainer.fit(SubmoduleModule(batch_size=4))
    after = {"in_step": seen.threads, "watchdog": seen.watchdog,
             "process_group_s": trainer.strategy._timeout.total_seconds(), "threads": _threads(),
             "environment": "TORCH_FR_BUFFER_SIZE" in os.environ}
    try:
        _trainer(world_size, root, _Failing()).fit(SubmoduleModule(batch_size=4))
    except ValueError:
        pass
    failed = {"threads": _threads(), "environment": "TORCH_FR_BUFFER_SIZE" in os.environ}
    if not dist.is_initialized():  # (teardown destroyed the default group: spawn's closing barrier needs one)
        dist.init_process_group("gloo", init_method=f"file://{root}/rejoin", rank=rank, world_size=world_size)
    return {"after_fit": after, "after_failed_fit": failed}


def nccl_ranks(rank: int, world_size: int, dump_dir: str, timeout_s: float, case: str) -> str:
    """The watchdog over NCCL's flight recorder (one GPU per rank; test_watchdog_nccl_gpu.py): after one
    all-reduce together, rank 1 sleeps past the timeout before the next (``case="sleepy"``) or calls an
    all-reduce of its own while rank 0 goes on to an all-gather (``case="mismatch"``)."""
    from titan_lightning.config import CommConfig
    from titan_lightning.parallel.watchdog import restore_environment, set_comm_environment

    comm = CommConfig(init_timeout_s=timeout_s, train_timeout_s=timeout_s)
    replaced = set_comm_environment(comm, Path(dump_dir), "nccl")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    watchdog = Watchdog.from_env(comm, Path(dump_dir), steps=lambda: 0)
    assert watchdog is not None
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    if rank == 1 and case == "sleepy":
        time.sleep(60)
    if rank == 1 and case == "mismatch":
        dist.all_reduce(x)
    if case == "mismatch":
        dist.all_gather([torch.zeros(4, device="cuda") for _ in range(world_size)], x)
    else:
        dist.all_reduce(x)
    torch.cuda.synchronize()
    watchdog.stop()
    restore_environment(replaced)
    return "finished"
