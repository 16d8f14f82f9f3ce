"""Rank functions for test_heartbeat.py (run by titan_lightning.testing.spawn on gloo ranks)."""

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from titan_lightning.parallel.heartbeat import Heartbeat
from titan_lightning.parallel.watchdog import Watchdog

QUICK = dict(interval_s=0.2, timeout_s=0.6)


def _heartbeat(rank: int, world_size: int, **timing) -> Heartbeat:
    return Heartbeat(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), **{**QUICK, **timing})


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
    """Rank 1 ends its heartbeat normally and waits while rank 0 is busy for longer than the
    timeout and the grace: nobody is taken for dead."""
    heartbeat = _heartbeat(rank, world_size, grace_s=0.5)
    dist.barrier()
    if rank == 1:
        heartbeat.stop()
    time.sleep(3.0)
    if rank != 1:
        heartbeat.stop()
    return "finished"


def stopped_rank(rank: int, world_size: int, stop_s: float, elsewhere: bool, dump_dir: str) -> str:
    """Rank 1 waits in an all-reduce; rank 0 stops it (SIGSTOP) for ``stop_s``, longer than the
    heartbeat's timeout and grace and the watchdog's timeout, continues it (SIGCONT) and joins the
    all-reduce. ``elsewhere``: rank 1 says it runs on another host (its pid is not visible to rank 0),
    as a rank of a multi-node run does."""
    heartbeat = _heartbeat(rank, world_size, grace_s=1.0)
    if elsewhere and rank == 1:
        _elsewhere(heartbeat)
    watchdog = Watchdog(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), init_timeout_s=2.0,
                        train_timeout_s=2.0, dump_dir=Path(dump_dir), interval_s=0.2)
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        time.sleep(0.5)  # (rank 1 is in the all-reduce, its watchdog counting)
        os.kill(pids[1], signal.SIGSTOP)
        time.sleep(stop_s)
        os.kill(pids[1], signal.SIGCONT)
        time.sleep(0.5)  # (rank 1's watchdog looks at its wait before the all-reduce can end)
    dist.all_reduce(torch.ones(1))
    watchdog.stop()
    heartbeat.stop()
    return "finished"


def _elsewhere(heartbeat: Heartbeat) -> None:
    """This rank's whereabouts as a rank on another host writes them: its pid is not visible to its peers."""
    key = f"{heartbeat._keys}/where/{heartbeat.rank}"
    heartbeat._store.set(key, json.dumps({**json.loads(heartbeat._store.get(key)), "space": "another host"}))


def killed_peer(rank: int, world_size: int, timeout_s: float, elsewhere: bool) -> dict:
    """The heartbeats of ``world_size`` ranks and of a peer, the last rank, that rank 0 starts. The
    peer's process is killed (SIGKILL); its watcher, rank ``world_size - 1`` (a beat a second;
    ``timeout_s`` for a silent peer elsewhere), asks its heartbeat who died, as the command line does
    after a failed collective. ``elsewhere``: the peer says it runs on another host."""
    if rank == 0:
        beating, told = os.pipe()
        pid = os.fork()  # (torch is imported already: a fork starts in no time)
        if pid == 0:
            _peer(world_size, elsewhere, told)
        assert os.read(beating, 1) == b"1"
    dist.barrier()
    heartbeat = Heartbeat(rank, world_size + 1, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          timeout_s=timeout_s, grace_s=30.0)
    time.sleep(2.5)  # (a few of the peer's beats seen by its watcher)
    if rank == 0:
        os.kill(pid, signal.SIGKILL)
    killed_at = [None] * world_size
    dist.all_gather_object(killed_at, time.time())
    told = {"pid": pid} if rank == 0 else {}
    if rank == world_size - 1:
        told.update(account=heartbeat.explain(), seconds=time.time() - killed_at[0])
    dist.barrier()
    heartbeat.stop()
    if rank == 0:
        os.waitpid(pid, 0)
    return told


def _peer(rank: int, elsewhere: bool, told: int) -> None:
    """``killed_peer``'s peer: a heartbeat of rank ``rank`` (that takes no peer for dead) until it is killed."""
    try:
        heartbeat = Heartbeat(rank, rank + 1, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              timeout_s=600.0)
        if elsewhere:
            _elsewhere(heartbeat)
        os.write(told, b"1")
        time.sleep(120)
    finally:
        os._exit(0)
