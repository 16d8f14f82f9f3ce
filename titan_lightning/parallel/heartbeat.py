"""Which rank died: a heartbeat per rank in the rendezvous store, each rank watching the next.

When a rank is killed (OOM killer, SIGKILL, a node lost), its peers see only the backend's
error ("Connection reset by peer"). With ``Heartbeat`` running, every rank counts up its own
key in the store once a second and watches its ring neighbour's; a neighbour whose count stops
for ``stall_s`` is marked dead in the store. ``explain()``, called by a rank whose collective
failed, waits a few seconds for such a mark and names the rank, its host and pid, and where its
output went. If the store itself is gone, its host (rank 0 under env:// launches) died.

A survivor may never see its collective fail: blocked on a peer that is alive (a ring step
waiting for rank 0), it would fail only when that peer leaves, and with rank 0 the store goes
too. So every rank's heartbeat also reads one "someone died" counter, and a rank whose main
thread has not called ``explain()`` within ``grace_s`` of a mark reports it itself (the same
one line) and exits with status 1.

Store traffic is O(world size) per second (one write and two reads per rank: its neighbour's count
and the "someone died" counter), not O(world size^2).
"""

import json
import os
import select
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

# The process group (and its store) outlives a fit: each fit's heartbeats count in keys of their own
# (every rank runs the same fits in the same order), so a second fit never reads the first one's marks.
_RUNS = {"heartbeat": 0}


def run_prefix(kind: str) -> str:
    """A fresh store-key prefix for this process's next ``kind`` (heartbeat, watchdog) of a fit."""
    _RUNS[kind] = _RUNS.get(kind, 0) + 1
    return f"titan_lightning/{kind}/{_RUNS[kind]}"


def output_target() -> str:
    """Where this process's stderr goes, as a reader would look for it."""
    try:
        target = os.readlink("/proc/self/fd/2")
    except OSError:
        return "its launcher's output"
    if target.startswith("/dev/pts/") or target.startswith("/dev/tty"):
        return f"the terminal {target}"
    if target.startswith("/"):
        return target
    return f"its launcher's log (stderr is a {target.split(':')[0]})"


class Heartbeat:
    """A daemon thread beating for this rank and watching rank ``(rank + 1) % world_size``."""

    def __init__(self, rank: int, world_size: int, host: str, port: int, *, interval_s: float = 1.0,
                 stall_s: float = 3.0, grace_s: float = 5.0) -> None:
        self.rank, self.world_size = rank, world_size
        self._keys = run_prefix("heartbeat")
        self.address = f"{host}:{port}"
        self.interval_s, self.stall_s, self.grace_s = interval_s, stall_s, grace_s
        # One reporter per process: the main thread's explain() or, when it never comes, the heartbeat's.
        self._report_lock = threading.Lock()
        self._reporting = False
        # A client of its own: the main thread's store connection stays untouched.
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10),
                                    wait_for_workers=False)
        self._store.set(f"{self._keys}/where/{rank}", json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "output": output_target()}))
        # An idle plain connection to the store: it reads end-of-file when the store's host dies, so
        # that death is seen without a store call, whose failure torch logs with a C++ stack dump.
        self._sentinel = socket.create_connection((host, port), timeout=10)
        self._sentinel_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="titan-lightning-heartbeat")
        self._thread.start()

    @classmethod
    def from_env(cls) -> Optional["Heartbeat"]:
        """For an env:// launch (torchrun, Lightning's launcher, SLURM) of several ranks; else None."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port or dist.get_backend() == "fake":
            return None
        try:
            return cls(dist.get_rank(), dist.get_world_size(), host, int(port))
        except (RuntimeError, ValueError, OSError):
            return None  # no store to reach: failures are reported without naming a rank

    def _run(self) -> None:
        watched = (self.rank + 1) % self.world_size
        last, since, marked, told_at = None, time.monotonic(), False, None
        while not self._stop.wait(self.interval_s):
            if self._store_gone():
                return  # explain() says so
            try:
                self._store.add(f"{self._keys}/beat/{self.rank}", 1)
                count = self._store.add(f"{self._keys}/beat/{watched}", 0)
                now = time.monotonic()
                if count != last:
                    last, since = count, now
                elif now - since > self.stall_s and not marked and not self._store.check([f"{self._keys}/done/{watched}"]):
                    self._store.set(f"{self._keys}/dead/{watched}", f"{now - since:.0f}")
                    self._store.add(f"{self._keys}/dead_any", 1)
                    marked = True
                if told_at is None and self._store.add(f"{self._keys}/dead_any", 0) > 0:
                    told_at = now
            except Exception:  # noqa: BLE001 - the store's host is gone; explain() says so
                return
            if told_at is not None and now - told_at > self.grace_s:
                self._report_stuck()
                return

    def _report_stuck(self) -> None:
        """A peer is dead and the main thread has not noticed (blocked on a live peer): report and leave."""
        with self._report_lock:
            if self._reporting:
                return  # the main thread is explaining
            self._reporting = True
        account = self._account(wait_s=0.0) or "a peer stopped beating (see the other ranks' output)"
        print(f"titan-lightning: error: [rank {self.rank}] {account}", file=sys.stderr, flush=True)
        os._exit(1)

    def stop(self) -> None:
        """This rank ends normally: its watcher must not take the silence for a death. The thread
        ends before this returns (none outlives ``trainer.fit``)."""
        try:
            if not self._store_gone():
                self._store.set(f"{self._keys}/done/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store's host already left at the end of the run
            pass
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 15)  # (a store call in flight times out in 10 s)
        self._sentinel.close()

    def _store_gone(self) -> bool:
        """The store's host has died: the sentinel connection reads end-of-file and a new connection
        is refused (a store that merely closed the sentinel gets a new one)."""
        with self._sentinel_lock:
            try:
                readable, _, _ = select.select([self._sentinel], [], [], 0)
                if not readable or self._sentinel.recv(1, socket.MSG_PEEK):
                    return False
            except (OSError, ValueError):  # (ValueError: closed by stop())
                pass
            host, port = self.address.rsplit(":", 1)
            try:
                sentinel = socket.create_connection((host, int(port)), timeout=2)
            except OSError:
                return True
            self._sentinel.close()
            self._sentinel = sentinel
            return False

    def explain(self, wait_s: float = 15.0) -> Optional[str]:
        """One line naming the rank(s) that stopped beating, waiting up to ``wait_s`` for the
        evidence; None when every rank still beats (the failure is something else)."""
        with self._report_lock:
            reporting, self._reporting = self._reporting, True
        while reporting:  # the heartbeat thread reports and ends the process
            time.sleep(1.0)
        return self._account(wait_s)

    def _account(self, wait_s: float) -> Optional[str]:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self._store_gone():
                    raise ConnectionError(self.address)
                dead = [r for r in range(self.world_size) if r != self.rank
                        and self._store.check([f"{self._keys}/dead/{r}"])]
                if dead:
                    account = "; ".join(self._describe(r) for r in dead)
                    self._linger(len(dead))  # after reading: rank 0 may leave (with the store) once told
                    return account
            except Exception:  # noqa: BLE001 - the store's host died
                return (f"rank 0 (the host of the rendezvous store {self.address}) is gone: killed, out of memory or "
                        f"crashed; its output: the launching process's")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)

    def _linger(self, dead: int, wait_s: float = 20.0) -> None:
        """Count this rank as told; rank 0, which hosts the store under env:// launches, stays until
        every surviving rank has read it (or ``wait_s``), so that none blames rank 0 for leaving.
        (5 s was too short on a loaded machine: a survivor whose collective failed later blamed rank 0.)"""
        told = self._store.add(f"{self._keys}/told", 1)
        deadline = time.monotonic() + wait_s
        while self.rank == 0 and told < self.world_size - dead and time.monotonic() < deadline:
            time.sleep(0.1)
            told = self._store.add(f"{self._keys}/told", 0)

    def _describe(self, rank: int) -> str:
        try:
            where = json.loads(self._store.get(f"{self._keys}/where/{rank}"))
        except Exception:  # noqa: BLE001
            where = {"host": "?", "pid": "?", "output": "unknown"}
        return (f"rank {rank} (pid {where['pid']} on {where['host']}) stopped: no heartbeat for {self.stall_s:.0f} s "
                f"(killed, out of memory or crashed); its output: {where['output']}")


def death_reported(store) -> bool:
    """Whether some rank's heartbeat has marked a peer dead (the watchdog then leaves it to the heartbeat)."""
    return store.add(f"titan_lightning/heartbeat/{_RUNS['heartbeat']}/dead_any", 0) > 0
