"""Which rank died: a heartbeat per rank in the rendezvous store, each rank watching the next.

When a rank is killed (OOM killer, SIGKILL, a node lost), its peers see only the backend's
error ("Connection reset by peer"). With ``Heartbeat`` running, every rank counts up its own
key in the store once a second and watches its ring neighbour. A neighbour on the same host (its
pid is visible here) is dead only once its process is gone (no such pid, a zombie, or another
process under its pid): a rank that is merely slow (stopped with SIGSTOP, swapping, in a long GC
pause, under a debugger) is never called dead for its silence. A neighbour on another host is
called dead when its count has stood still for ``timeout_s`` (``comm.heartbeat_timeout_s``, tens
of seconds). The dead rank is marked in the store. ``explain()``, called by a rank whose
collective failed, looks at every rank the same way (the survivors' own heartbeats have stopped
by then) and names the dead one, its host and pid, how it ended (a zombie's exit status: "was
killed by SIGKILL") and where its output went; a rank this process started (Lightning's launcher)
is left to the launcher's own watch, which says the same. If the store itself is gone, its host
(rank 0 under env:// launches) died.

A survivor may never see its collective fail: blocked on a peer that is alive (a ring step
waiting for rank 0), it would fail only when that peer leaves, and with rank 0 the store goes
too. So every rank's heartbeat also reads one "someone died" counter, and a rank whose main
thread has not called ``explain()`` within ``grace_s`` of a mark reports it itself (the same
one line) and exits with status 1.

Store traffic is O(world size) per second (a few calls per rank: its beat, its neighbour's marks and
count, the "someone died" counter), not O(world size^2).
"""

import json
import math
import os
import select
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch.distributed as dist

# The process group (and its store) outlives a fit: each fit's heartbeats count in keys of their own
# (every rank runs the same fits in the same order), so a second fit never reads the first one's marks.
_RUNS = {"heartbeat": 0}

ALIVE, DEAD, SILENT = "alive", "dead", "silent"  # what a rank's watcher knows of it
# After a failure, how long the first store call waits for the store's connection to close: a dying
# rank 0 closes its sockets one by one, its peers' (which failed the collective) before the store's.
SETTLE_S = 0.25
_RUNNING: list[Optional["Heartbeat"]] = [None]  # this process's running heartbeat


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


def error(line: str, *, fresh_line: bool = False) -> None:
    """The run's one error line on stderr; ``fresh_line``: on a line of its own (a progress bar
    may be drawing on the same screen, its line not ended)."""
    print(f"{chr(10) if fresh_line else ''}titan-lightning: error: {line}", file=sys.stderr, flush=True)


def _pid_space() -> Optional[str]:
    """Which processes this one can see by pid: its machine's boot and its pid namespace (None without /proc)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _stat(pid: int) -> Optional[tuple[str, str, Optional[int]]]:
    """The state, start time (clock ticks since boot) and, once it has ended, the wait status of
    process ``pid``; None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # (the name in parentheses may hold spaces)
    return fields[0], fields[19], int(fields[49]) if len(fields) > 49 and fields[0] in "ZXx" else None


def whereabouts() -> dict:
    """How peers find this process and tell whether it is alive."""
    stat = _stat(os.getpid())
    return {"host": socket.gethostname(), "pid": os.getpid(), "ppid": os.getppid(), "output": output_target(),
            "space": _pid_space(), "start": stat[1] if stat is not None else None}


def process_ended(where: dict) -> Optional[str]:
    """How the process ``where`` (a peer's ``whereabouts()``) ended: no such pid, a zombie, or another
    process under its pid; "" while it runs (or is stopped); None where its pid is not visible from
    here (another host)."""
    if where.get("space") is None or where["space"] != _pid_space():
        return None
    stat = _stat(where["pid"])
    if stat is not None and stat[1] == where["start"]:
        state, _, status = stat
        if state not in "ZXx":
            return ""
        if status is not None and status & 0x7F:
            name = signal.Signals(status & 0x7F).name
            return f"was killed by {name} (the out-of-memory killer, a scheduler or a user)"
        if status is not None:
            return f"exited with status {status >> 8} without ending its run"
    return "is gone: its process ended (killed, out of memory or crashed)"


class Heartbeat:
    """A daemon thread beating for this rank and watching rank ``(rank + 1) % world_size``."""

    def __init__(self, rank: int, world_size: int, host: str, port: int, *, interval_s: float = 1.0,
                 timeout_s: float = 60.0, grace_s: float = 5.0, progress_bar: bool = False) -> None:
        self.rank, self.world_size = rank, world_size
        self._keys = run_prefix("heartbeat")
        self.address = f"{host}:{port}"
        self.interval_s, self.timeout_s, self.grace_s = interval_s, timeout_s, grace_s
        self.progress_bar = progress_bar  # (a progress bar may share the screen: errors start a new line)
        self._where: dict[int, dict] = {}  # the peers' whereabouts(), once read
        self._counts: dict[int, tuple[int, float, bool]] = {}  # rank -> (its count, seen since, seen to change)
        # One reporter per process: the main thread's explain() or, when it never comes, the heartbeat's.
        self._report_lock = threading.Lock()
        self._reporting = False
        # A client of its own: the main thread's store connection stays untouched.
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10),
                                    wait_for_workers=False)
        self._store.set(f"{self._keys}/where/{rank}", json.dumps(whereabouts()))
        # An idle plain connection to the store: it reads end-of-file when the store's host dies, so
        # that death is seen without a store call, whose failure torch logs with a C++ stack dump.
        self._sentinel = socket.create_connection((host, port), timeout=10)
        self._sentinel_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="titan-lightning-heartbeat")
        self._thread.start()
        _RUNNING[0] = self

    @classmethod
    def from_env(cls, timeout_s: float = 60.0, progress_bar: bool = False) -> Optional["Heartbeat"]:
        """For an env:// launch (torchrun, Lightning's launcher, SLURM) of several ranks; else None."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port or dist.get_backend() == "fake":
            return None
        try:
            return cls(dist.get_rank(), dist.get_world_size(), host, int(port), timeout_s=timeout_s,
                       progress_bar=progress_bar)
        except (RuntimeError, ValueError, OSError):
            return None  # no store to reach: failures are reported without naming a rank

    def _run(self) -> None:
        watched = (self.rank + 1) % self.world_size
        marked, told_at = False, None
        while not self._stop.wait(self.interval_s):
            if self._store_gone():
                return  # explain() says so
            try:
                self._store.add(f"{self._keys}/beat/{self.rank}", 1)
                now = time.monotonic()
                if not marked and self._judge(watched, now) == DEAD:
                    marked = True
                if told_at is None and self._store.add(f"{self._keys}/dead_any", 0) > 0:
                    told_at = now
            except Exception:  # noqa: BLE001 - the store's host is gone; explain() says so
                return
            if told_at is not None and now - told_at > self.grace_s:
                self._report_stuck()
                return

    def _judge(self, rank: int, now: float, beat_after: float = -math.inf) -> str:
        """ALIVE, DEAD (marked in the store) or SILENT for ``rank`` (see the module's docstring). A rank
        on another host is SILENT until its count is seen to change after ``beat_after``, DEAD once
        it has stood still for ``timeout_s``."""
        if self._store.check([f"{self._keys}/dead/{rank}"]):
            return DEAD
        if self._store.check([f"{self._keys}/done/{rank}"]):
            return ALIVE  # it stopped beating on purpose (its run ended, or failed and is leaving)
        if rank not in self._where and self._store.check([f"{self._keys}/where/{rank}"]):
            self._where[rank] = json.loads(self._store.get(f"{self._keys}/where/{rank}"))
        ended = process_ended(self._where[rank]) if rank in self._where else None
        if ended == "":
            return ALIVE
        if ended is None:
            count = self._store.add(f"{self._keys}/beat/{rank}", 0)
            seen, since, changed = self._counts.get(rank, (None, now, False))
            if count != seen:
                seen, since, changed = count, now, seen is not None
                self._counts[rank] = (seen, since, changed)
            if now - since <= self.timeout_s:
                return ALIVE if changed and since > beat_after else SILENT
            how = (f"stopped: no heartbeat for {now - since:.0f} s (comm.heartbeat_timeout_s={self.timeout_s:g}; "
                   f"killed, out of memory, crashed, or its host is unreachable)")
        else:
            how = ended
        if self._store_gone():  # (rank 0's process, the store's host, is gone: no store call that fails)
            raise ConnectionError(self.address)
        self._store.set(f"{self._keys}/dead/{rank}", how)
        self._store.add(f"{self._keys}/dead_any", 1)
        return DEAD

    def _report_stuck(self) -> None:
        """A peer is dead and the main thread has not noticed (blocked on a live peer): report and leave."""
        with self._report_lock:
            if self._reporting:
                return  # the main thread is explaining
            self._reporting = True
        account = self._account(wait_s=0.0) or "a peer stopped beating (see the other ranks' output)"
        error(f"[rank {self.rank}] {account}", fresh_line=self.progress_bar)
        os._exit(1)

    def stop(self, failed: bool = False) -> None:
        """This rank's fit ended (normally, or it ``failed`` and the rank is leaving): its watcher
        must not take the silence for a death. The thread ends before this returns (none outlives
        ``trainer.fit``); ``explain()`` still works."""
        self._stop.set()
        if _RUNNING[0] is self:
            _RUNNING[0] = None
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 15)  # (a store call in flight times out in 10 s)
        try:
            if not self._store_gone(settle_s=SETTLE_S if failed else 0.0):
                self._store.set(f"{self._keys}/done/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store's host already left at the end of the run
            pass
        if not failed:  # (after a failure explain() reads it: a new connection could reach a dying host)
            self._sentinel.close()

    def _store_gone(self, settle_s: float = 0.0) -> bool:
        """The store's host has died: the sentinel connection reads end-of-file (waited for up to
        ``settle_s``) and a new connection is refused (a store that merely closed the sentinel gets
        a new one)."""
        with self._sentinel_lock:
            try:
                readable, _, _ = select.select([self._sentinel], [], [], settle_s)
                if not readable or self._sentinel.recv(1, socket.MSG_PEEK):
                    return False
                time.sleep(0.1)  # (end-of-file: a dying host closes its listening socket a moment later)
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

    def explain(self, wait_s: Optional[float] = None) -> Optional[str]:
        """One line naming the rank(s) that died, once the evidence is in (at most ``wait_s``, by
        default ``timeout_s`` and a little: a silent rank on another host); None as soon as every
        other rank is seen alive (the failure is something else)."""
        with self._report_lock:
            reporting, self._reporting = self._reporting, True
        while reporting:  # the heartbeat thread reports and ends the process
            time.sleep(1.0)
        return self._account(self.timeout_s + 2 * self.interval_s if wait_s is None else wait_s)

    def _account(self, wait_s: float) -> Optional[str]:
        start = time.monotonic()
        deadline, settle_s = start + wait_s, SETTLE_S
        while True:
            try:
                if self._store_gone(settle_s):
                    raise ConnectionError(self.address)
                now = time.monotonic()
                # (a rank elsewhere is alive if it beats now: one that beat a moment ago may have just died)
                verdicts = {r: self._judge(r, now, beat_after=start) for r in range(self.world_size) if r != self.rank}
                settle_s = 0.0
                dead = [r for r, verdict in verdicts.items() if verdict == DEAD]
                if dead:
                    self._defer_to_launcher(dead)
                    account = "; ".join(self._describe(r) for r in dead)
                    self._linger(len(dead))  # after reading: rank 0 may leave (with the store) once told
                    return account
            except Exception:  # noqa: BLE001 - the store's host died
                return (f"rank 0 (the host of the rendezvous store {self.address}) is gone: killed, out of memory or "
                        f"crashed; its output: the launching process's")
            if all(verdict == ALIVE for verdict in verdicts.values()) or time.monotonic() >= deadline:
                return None
            time.sleep(0.2)

    def _defer_to_launcher(self, dead: list[int], wait_s: float = 5.0) -> None:
        """A dead rank this process started (Lightning's launcher: rank 0 starts the others) is
        reported by the launcher's watch, with its exit status, and every rank stopped: give it
        the time to do so (it ends this process) rather than saying it twice."""
        if any(self._where.get(r, {}).get("ppid") == os.getpid() for r in dead):
            time.sleep(wait_s)

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
            how = self._store.get(f"{self._keys}/dead/{rank}").decode()
        except Exception:  # noqa: BLE001
            where, how = {"host": "?", "pid": "?", "output": "unknown"}, "stopped beating"
        return f"rank {rank} (pid {where['pid']} on {where['host']}) {how}; its output: {where['output']}"


def store_gone() -> bool:
    """Whether the running heartbeat has seen the store's host die (the watchdog then makes no store
    call, whose failure torch would log with a C++ stack dump)."""
    heartbeat = _RUNNING[0]
    return heartbeat is not None and heartbeat._store_gone()


def death_reported(store) -> bool:
    """Whether some rank's heartbeat has marked a peer dead (the watchdog then leaves it to the heartbeat)."""
    return store.add(f"titan_lightning/heartbeat/{_RUNS['heartbeat']}/dead_any", 0) > 0
