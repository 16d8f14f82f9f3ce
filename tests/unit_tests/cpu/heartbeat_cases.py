"""Rank functions for test_heartbeat.py (run by titan_lightning.testing.spawn on gloo ranks)."""

import os
import time

import torch
import torch.distributed as dist

from titan_lightning.parallel.heartbeat import Heartbeat

QUICK = dict(interval_s=0.2, stall_s=0.6)


def _heartbeat(rank: int, world_size: int, **timing) -> Heartbeat:
    return Heartbeat(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), **QUICK, **timing)


def blocked_survivor(rank: int, world_size: int) -> None:
    """Rank 1 dies; rank 2 waits on rank 0, which is alive and never sends: only the heartbeat can
    tell rank 2 (rank 0 reports later than rank 2, so rank 2 reads the store while rank 0 is up)."""
    heartbeat = _heartbeat(rank, world_size, grace_s=30.0 if rank == 0 else 1.0)
    dist.barrier()
    time.sleep(1.0)  # a few beats each
    if rank == 1:
        os._exit(0)  # gone without a word: no error of its own, no "done"
    if rank == 2:
        dist.recv(torch.zeros(1), src=0)  # blocks: rank 0 is alive and sends nothing
    time.sleep(120)  # rank 0: busy (the launch ends it once rank 2 has failed)
    heartbeat.stop()


def early_finisher(rank: int, world_size: int) -> str:
    """Rank 1 ends its heartbeat normally and waits while rank 0 is busy for longer than the stall
    and the grace: nobody is taken for dead."""
    heartbeat = _heartbeat(rank, world_size, grace_s=0.5)
    dist.barrier()
    if rank == 1:
        heartbeat.stop()
    time.sleep(3.0)
    if rank != 1:
        heartbeat.stop()
    return "finished"
