"""Which rank hangs: a watchdog per rank over torch's flight recorder.

A rank stuck inside a step (a deadlock in user code, a slow file system, an endless loop) is
alive and beats (heartbeat.py) while its peers wait for it in a collective until the process
group's timeout. torch's flight recorder (``TORCH_FR_BUFFER_SIZE``, gloo and NCCL) counts, per
process group, the collectives a rank enqueued and those that completed; the watchdog thread
reads those counters once a second (a few microseconds). When a collective of this rank has
waited longer than ``comm.init_timeout_s`` (before the first optimizer step) or
``comm.train_timeout_s`` (after; for a LightningModule without a job both are the strategy's
``timeout``), not counting time this process itself did not run (stopped, swapped out), the
first rank to see it asks every rank, through the
rendezvous store, for its account: the last collective it entered in that group, the one it
entered under that sequence number, the ones it waits in, where its main thread is. Each rank
writes its Python stacks (faulthandler) and its flight recorder to ``<dump_dir>/rank<r>_stacks.txt``
and ``rank<r>_flight_recorder.json``. One line names the rank(s) that never entered the
collective, or, when every rank entered one under that number but not the same one (a rank that
called a collective its peers did not: torch's flight-recorder analyzer compares the same way),
the ranks and their two collectives; with how long it waited and where the stuck rank is. When
every rank has entered the same collective, the last of them less than the timeout before (late, not
stuck: a loaded machine, a slow step), the incident is withdrawn and the run goes on, the wait counted
again from that rank's entry; a collective every rank entered and that stays open for the timeout is
the network's or the backend's hang. A rank's own open collective that another rank has completed
(an async one it has not waited on: its main thread is stuck elsewhere) turns the question to the
collective the furthest rank waits in. After a verdict every rank exits with status 1, rank 0 last (it
hosts the store under env:// launches; under Lightning's launcher its exit is the run's, and
``on_hang`` keeps the launcher from reporting the others' exit).

The process groups' own timeout comes ``BACKSTOP_S`` later (``process_group_timeout``): it ends
the run, with torch's error (under NCCL, torch's flight-recorder dump), only if the watchdog
could not. Collectives of ``ignore``d groups (the checkpoint writer's own) are left to it.
Point-to-point transfers (pipeline stages) are not watched: their waits end at that timeout.
"""

import faulthandler
import json
import math
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch.distributed as dist

from titan_lightning._compat import flight_recorders, process_group_names
from titan_lightning.config.comm import CommConfig
from titan_lightning.parallel.heartbeat import death_reported, error, run_prefix, store_gone, whereabouts

BACKSTOP_S = 60.0
WITHDRAWN = "withdrawn"  # the verdict of an incident that proved a late rank, not a hang


def set_comm_environment(comm: CommConfig, dump_dir: Path, backend: Optional[str]) -> dict[str, Optional[str]]:
    """Before the process group exists: the flight recorder's size and, under NCCL, torchtitan's
    settings (dump the recorder when a collective times out; tear the process down on an error).
    Returns what they replaced, for ``restore_environment`` once the run is over (none is left behind)."""
    wanted = {"TORCH_FR_BUFFER_SIZE": str(comm.trace_buf_size)}
    if backend is not None and "nccl" in backend:
        wanted["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"  # 1 aborts before the recorder is dumped
        if comm.trace_buf_size > 0:
            wanted["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
            wanted["TORCH_FR_DUMP_TEMP_FILE"] = str(dump_dir / "nccl_timeout_rank")
    previous = {name: os.environ.get(name) for name in wanted}
    for name, value in wanted.items():
        if name == "TORCH_FR_BUFFER_SIZE" or name not in os.environ:  # (the user's NCCL settings win)
            os.environ[name] = value
    if "TORCH_FR_DUMP_TEMP_FILE" in wanted and previous["TORCH_FR_DUMP_TEMP_FILE"] is None:
        dump_dir.mkdir(parents=True, exist_ok=True)
    return previous


def restore_environment(previous: dict[str, Optional[str]]) -> None:
    """The environment as ``set_comm_environment`` found it."""
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def process_group_timeout(comm: CommConfig) -> timedelta:
    """The process groups' own timeout: a backstop behind the watchdog's."""
    return timedelta(seconds=max(comm.init_timeout_s, comm.train_timeout_s) + BACKSTOP_S)


def _recorders() -> dict[str, Callable[..., bytes]]:
    """torch's flight recorders: the generic one (gloo, ...) and, in CUDA builds, NCCL's."""
    return flight_recorders()


def _main_thread_at() -> str:
    """Where the main thread is: its innermost Python frame, and the innermost one of the user's
    code (outside site-packages) when that is another."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown"

    def describe(f) -> str:
        return f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})"

    where, inner = describe(frame), frame
    while inner is not None and ("site-packages" in inner.f_code.co_filename
                                 or inner.f_code.co_filename.startswith(sys.prefix)):
        inner = inner.f_back
    if inner is not None and inner is not frame:
        where += f" <- {describe(inner)}"
    return where


def _group_ranks(name: str, world_size: int) -> list[int]:
    try:
        for group, group_name in process_group_names().items():
            if group_name == name:
                return dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - torch's registry changed: every rank answers anyway
        pass
    return list(range(world_size))


class Watchdog:
    """A daemon thread that ends a hung run, naming the rank it waits for (see the module's docstring)."""

    def __init__(self, rank: int, world_size: int, host: str, port: int, *, init_timeout_s: float,
                 train_timeout_s: float, dump_dir: Path, steps: Callable[[], int] = lambda: 0,
                 ignore: Iterable[Any] = (), on_hang: Callable[[], None] = lambda: None, interval_s: float = 1.0,
                 answer_s: float = 5.0, fields: tuple[str, str] = ("comm.init_timeout_s", "comm.train_timeout_s"),
                 progress_bar: bool = False) -> None:
        self.rank, self.world_size = rank, world_size
        self._keys = run_prefix("watchdog")
        self._incident = 0  # (a suspected hang that proved a late rank is withdrawn: the next one has new keys)
        self.init_timeout_s, self.train_timeout_s = init_timeout_s, train_timeout_s
        self.fields = fields  # what the verdict calls the two timeouts (where the user sets them)
        self.progress_bar = progress_bar  # (a progress bar may share the screen: the verdict starts a new line)
        self.dump_dir, self.interval_s, self.answer_s = Path(dump_dir), interval_s, answer_s
        self._steps, self._on_hang = steps, on_hang
        self._ignore = {group.group_name for group in ignore if group is not None}
        self._ignored: set[tuple[str, str]] = set()  # (recorder, pg id) of ignored groups
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10),
                                    wait_for_workers=False)
        self._store.set(f"{self._keys}/where/{rank}", json.dumps(whereabouts()))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="titan-lightning-watchdog")
        self._thread.start()

    @classmethod
    def from_env(cls, comm: CommConfig, dump_dir: Path, steps: Callable[[], int], ignore: Iterable[Any] = (),
                 on_hang: Callable[[], None] = lambda: None, **options: Any) -> Optional["Watchdog"]:
        """For an env:// launch of several ranks with the flight recorder on; else None. ``steps``: the
        optimizer steps done; ``on_hang``: called on rank 0 once a hang is found, before any rank leaves;
        ``options``: the constructor's (``fields``, ``progress_bar``)."""
        if comm.trace_buf_size == 0 or not (dist.is_available() and dist.is_initialized()):
            return None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if dist.get_world_size() == 1 or not host or not port or dist.get_backend() == "fake":
            return None
        try:
            return cls(dist.get_rank(), dist.get_world_size(), host, int(port), init_timeout_s=comm.init_timeout_s,
                       train_timeout_s=comm.train_timeout_s, dump_dir=dump_dir, steps=steps, ignore=ignore,
                       on_hang=on_hang, **options)
        except (RuntimeError, ValueError, OSError):
            return None  # no store to reach: the process groups' timeout alone

    def stop(self) -> None:
        """The run ended: the thread ends before this returns."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 15)

    # -- watching ------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        """The store key ``name`` of the current incident (request, answers, claim, verdict, ...)."""
        return f"{self._keys}/{self._incident}/{name}"

    def _run(self) -> None:
        pending: dict[tuple[str, str], tuple[int, float]] = {}  # (recorder, pg id) -> (oldest open seq, seen since)
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            # This process did not run for a while (stopped, swapped out, starved): that time is not
            # its peers' delay, and its collectives' waits exclude it.
            now = time.monotonic()
            gap, last = now - last - self.interval_s, now
            if gap > max(2.0, 2 * self.interval_s):
                pending = {key: (seq, since + gap) for key, (seq, since) in pending.items()}
            if store_gone():
                return  # (the heartbeat names rank 0)
            try:
                if self._store.check([self._key("request")]):
                    self._answer()  # (returns only when the incident was withdrawn; a verdict leaves)
                    self._incident += 1  # (withdrawn: the collective's late rank had just entered it)
                    pending.clear()
                    continue
                if death_reported(self._store):
                    continue  # a rank died: the heartbeat names it
                now = time.monotonic()
                for source, dump in _recorders().items():
                    for pg_id, status in json.loads(dump(False)).get("pg_status", {}).items():
                        done, enqueued = int(status["last_completed_collective"]), int(status["last_enqueued_collective"])
                        key = (source, pg_id)
                        if enqueued <= done:
                            pending.pop(key, None)
                        elif pending.get(key, (None,))[0] != done + 1:
                            pending[key] = (done + 1, now)
                timeout_s, field = ((self.train_timeout_s, self.fields[1]) if self._steps_done() > 0
                                    else (self.init_timeout_s, self.fields[0]))
                for key, (seq, since) in pending.items():
                    if key in self._ignored or now - since <= timeout_s:
                        continue
                    entry = self._entry(*key, seq)
                    if entry is None or entry["process_group"][0] in self._ignore:
                        self._ignored.add(key)
                    elif self._store.add(self._key("claim"), 1) == 1:
                        late_s = self._coordinate(entry, now - since, timeout_s, field)  # (or leaves)
                        self._incident += 1
                        # (the wait is counted again from when the last rank entered the collective)
                        pending[key] = (seq, time.monotonic() - late_s)
                        break
            except Exception:  # noqa: BLE001 - the store's host is gone (the run is ending)
                return

    def _steps_done(self) -> int:
        try:
            return int(self._steps())
        except Exception:  # noqa: BLE001 - the trainer is not attached (yet, or any more)
            return 0

    @staticmethod
    def _entry(source: str, pg_id: str, seq: int) -> Optional[dict]:
        for entry in json.loads(_recorders()[source](True)).get("entries", []):
            if str(entry["pg_id"]) == pg_id and entry["collective_seq_id"] == seq and not entry["is_p2p"]:
                return entry
        return None

    # -- the verdict ---------------------------------------------------------------------

    def _leave(self) -> None:
        """A hang was found and reported: leave, rank 0 last, once the others have left (it hosts the
        store under env:// launches, and is the run's process under Lightning's launcher); the others
        only once rank 0 has called ``on_hang`` (which keeps the launcher from reporting their exit)."""
        try:
            deadline = time.monotonic() + self.answer_s
            if self.rank == 0:
                self._on_hang()
                self._store.set(self._key("hang_seen"), "1")
                while self._store.add(self._key("left"), 0) < self.world_size - 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
            else:
                while not self._store.check([self._key("hang_seen")]) and time.monotonic() < deadline:
                    time.sleep(0.05)
                self._store.add(self._key("left"), 1)
        finally:
            sys.stderr.flush()
            os._exit(1)

    def _coordinate(self, entry: dict, waited_s: float, timeout_s: float, field: str) -> float:
        """This rank saw the hang first: it gathers every rank's account and says who hangs, then
        leaves. Or, when every rank has entered the collective, the last of them less than the
        timeout ago (a rank that was slow, not stuck: it came in while the accounts were asked), it
        withdraws the incident and returns how long ago that rank entered; the run goes on."""
        name, desc = entry["process_group"][0], entry["process_group"][1]
        request = {"rank": self.rank, "group": name, "desc": desc, "seq": entry["collective_seq_id"],
                   "op": entry["profiling_name"], "waited_s": waited_s, "timeout_s": timeout_s, "field": field,
                   "ranks": _group_ranks(name, self.world_size)}
        try:
            self._store.set(self._key("request"), json.dumps(request))
            self._store.set(self._key(f"answer/{self.rank}"), json.dumps(self._account(request)))
            answers, deadline = {}, time.monotonic() + self.answer_s
            while len(answers) < self.world_size and time.monotonic() < deadline:
                for rank in range(self.world_size):
                    if rank not in answers and self._store.check([self._key(f"answer/{rank}")]):
                        answers[rank] = json.loads(self._store.get(self._key(f"answer/{rank}")))
                time.sleep(0.1)
            request = self._retarget(request, answers)
            late_s = self._late(request, answers)
            if late_s is not None:
                self._store.set(self._key("verdict"), WITHDRAWN)
                return late_s
            line = self._verdict(request, answers)
            error(f"[rank {self.rank}] {line}", fresh_line=self.progress_bar)
            self._store.set(self._key("verdict"), line)
        except Exception:  # noqa: BLE001 - the store's host is gone (the run is ending)
            pass
        self._leave()

    def _answer(self) -> None:
        """Another rank saw the hang: this rank's account, then the verdict in its own log (when it has
        one) and leave; or return: the incident was withdrawn (a late rank, not a stuck one), go on."""
        try:
            request = json.loads(self._store.get(self._key("request")))
            mine = self._account(request)
            self._store.set(self._key(f"answer/{self.rank}"), json.dumps(mine))
            deadline = time.monotonic() + self.answer_s + 10
            while not self._store.check([self._key("verdict")]) and time.monotonic() < deadline:
                time.sleep(0.05)
            given = self._store.check([self._key("verdict")])
            verdict = self._store.get(self._key("verdict")).decode() if given else None
            if verdict == WITHDRAWN:
                return
            coordinator = json.loads(self._store.get(self._key(f"answer/{request['rank']}")))
            if coordinator["output"] != mine["output"] and verdict is not None:
                error(f"[rank {self.rank}] {verdict}", fresh_line=self.progress_bar)  # (torchrun --log-dir)
        except Exception:  # noqa: BLE001 - the store's host is gone (the run is ending)
            pass
        self._leave()

    @staticmethod
    def _retarget(request: dict, answers: dict[int, dict]) -> dict:
        """The request as asked, or, when its collective completed on another rank (this rank's main
        thread, stuck elsewhere in its step, has not waited on it: an async collective whose
        completion a rank records when it waits), the collective the furthest rank waits in: its
        number, name and waiter, with how long that rank has waited."""
        if not any(a.get("completed", 0) >= request["seq"] for a in answers.values()):
            return request
        waiters = [a for a in answers.values() if a.get("opened") and a["opened"]["seq"] > request["seq"]]
        if not waiters:
            return request
        waiter = max(waiters, key=lambda a: a["opened"]["seq"])
        opened = waiter["opened"]
        return {**request, "rank": waiter["rank"], "seq": opened["seq"], "op": opened["op"],
                "waited_s": opened["waited_s"], "retargeted": True}

    @staticmethod
    def _late(request: dict, answers: dict[int, dict]) -> Optional[float]:
        """Seconds since the last rank of the request's group entered the collective, when every rank
        answered and entered the same collective under its number, the last less than the timeout
        ago; else None (a hang: a rank never entered it, did not answer, entered another one, or the
        collective has had the timeout since everyone entered)."""
        ranks = request["ranks"]
        if request.get("retargeted"):  # (its waiter's wait is the one the timeout bounds)
            return request["waited_s"] if request["waited_s"] < request["timeout_s"] else None
        if any(r not in answers or answers[r].get("entered_s") is None for r in ranks):
            return None
        if Watchdog._mismatch(request, answers):
            return None
        late_s = min(answers[r]["entered_s"] for r in ranks)
        return late_s if late_s < request["timeout_s"] else None

    def _account(self, request: dict) -> dict:
        """This rank's stacks and flight recorder to files; for the store: the last collective it
        entered in the request's group, the one it entered under the request's sequence number (its
        name and sizes), those it waits in, where its main thread is."""
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        with open(self.dump_dir / f"rank{self.rank}_stacks.txt", "w") as out:
            faulthandler.dump_traceback(out, all_threads=True)
        traces = {source: json.loads(dump(True)) for source, dump in _recorders().items()}
        (self.dump_dir / f"rank{self.rank}_flight_recorder.json").write_text(json.dumps(traces))
        entered, completed, called, entered_s, waiting, now_ns = 0, 0, None, None, [], time.time_ns()
        in_group: dict[int, dict] = {}  # (this rank's recorded collectives of the request's group, by number)
        for trace in traces.values():
            entries = [e for e in trace.get("entries", []) if not e["is_p2p"]]
            ids = {str(e["pg_id"]) for e in entries if e["process_group"][0] == request["group"]}
            for pg_id in ids:
                status = trace.get("pg_status", {}).get(pg_id, {})
                entered = max(entered, int(status.get("last_enqueued_collective", 0)))
                completed = max(completed, int(status.get("last_completed_collective", 0)))
            in_group.update({e["collective_seq_id"]: e for e in entries if e["process_group"][0] == request["group"]})
            for e in entries:
                if not e["retired"] and e["state"] != "completed":
                    waiting.append(f"{e['profiling_name']} #{e['collective_seq_id']} of process group "
                                   f"{_group_label(e['process_group'])} for {(now_ns - e['time_created_ns']) / 1e9:.0f} s")
        if request["seq"] in in_group:
            e = in_group[request["seq"]]
            called = {"op": e["profiling_name"], "sizes": _sizes(e)}
            entered_s = (now_ns - e["time_created_ns"]) / 1e9
        # The oldest collective of the group after the request's that this rank entered and has not seen
        # complete (a rank that has not waited on the request's own, done on the wire, waits in a later one).
        opened, first = None, max(completed, request["seq"]) + 1
        if entered >= first and first in in_group:
            e = in_group[first]
            opened = {"seq": first, "op": e["profiling_name"], "waited_s": (now_ns - e["time_created_ns"]) / 1e9}
        where = json.loads(self._store.get(f"{self._keys}/where/{self.rank}"))
        return {**where, "rank": self.rank, "step": self._steps_done(), "entered": entered, "called": called,
                "entered_s": entered_s if entered >= request["seq"] else None, "completed": completed,
                "opened": opened, "waiting": waiting, "at": _main_thread_at()}

    def _verdict(self, request: dict, answers: dict[int, dict]) -> str:
        op = f"{request['op']} #{request['seq']} of process group {_group_label([request['group'], request['desc']])}"
        ranks = request["ranks"]
        waited = (f"in which rank {request['rank']} has waited {math.floor(request['waited_s'])} s "
                  f"({request['field']}={request['timeout_s']:g})")
        behind = [answers[r] for r in ranks if r in answers and answers[r]["entered"] < request["seq"]]
        silent = [r for r in ranks if r not in answers]
        parts = []
        for a in behind:
            also = f"; it waits in {', '.join(a['waiting'])}" if a["waiting"] else ""
            parts.append(f"rank {a['rank']} (pid {a['pid']} on {a['host']}) never entered {op}, {waited}; "
                         f"rank {a['rank']} is at step {a['step']} in {a['at']}{also}")
        for r in silent:
            where = self._where(r)
            parts.append(f"rank {r} (pid {where.get('pid', '?')} on {where.get('host', '?')}) did not answer "
                         f"within {self.answer_s:g} s (its process is stopped, or a thread holds the GIL); "
                         f"the others wait in {op}, {waited}")
        if not parts:
            parts = self._mismatch(request, answers)
        if not parts:
            parts.append(f"every rank of process group {_group_label([request['group'], request['desc']])} "
                         f"(ranks {', '.join(map(str, ranks))}) entered {request['op']} #{request['seq']} and it has "
                         f"not completed ({waited}): the network or the backend hangs, not a rank")
        return f"hung collective: {'; '.join(parts)}. Python stacks and flight recorder of every rank: {self.dump_dir}"

    @staticmethod
    def _mismatch(request: dict, answers: dict[int, dict]) -> list[str]:
        """Every rank entered a collective under the request's number: those whose collective (its name,
        else its sizes) differs from the most common one's, each with where it is; [] when all agree."""
        calls = {r: answers[r]["called"] for r in request["ranks"] if r in answers and answers[r].get("called")}
        if len(calls) < 2:
            return []
        key = {r: (c["op"], c["sizes"]) for r, c in calls.items()}
        groups: dict[tuple, list[int]] = {}
        for r, k in key.items():
            groups.setdefault(k, []).append(r)
        if len(groups) == 1:
            return []
        # The most common collective is taken as the program's (ties: the one rank 0, or the lowest rank, called).
        common = max(groups, key=lambda k: (len(groups[k]), -min(groups[k])))
        ranks = groups[common]
        label = _group_label([request["group"], request["desc"]])
        op, seq = common[0], request["seq"]
        parts = []
        for k, odd in groups.items():
            if k == common:
                continue
            what = k[0] if k[0] != op else f"{k[0]} with sizes {k[1]}"
            theirs = op if k[0] != op else f"{op} with sizes {common[1]}"
            for r in odd:
                a = answers[r]
                parts.append(f"rank {r} (pid {a['pid']} on {a['host']}) entered {what} #{seq} of process group {label} "
                             f"where rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} entered {theirs} "
                             f"#{seq} (mismatched collectives; waited {math.floor(request['waited_s'])} s, "
                             f"{request['field']}={request['timeout_s']:g}); "
                             f"rank {r} is at step {a['step']} in {a['at']}; "
                             f"rank {ranks[0]} is at step {answers[ranks[0]]['step']} in {answers[ranks[0]]['at']}")
        return parts

    def _where(self, rank: int) -> dict:
        try:
            return json.loads(self._store.get(f"{self._keys}/where/{rank}"))
        except Exception:  # noqa: BLE001
            return {}


def _sizes(entry: dict) -> str:
    """A collective's tensor sizes as the flight recorder has them: ``[4, 8] -> [2, 4, 8]``."""
    return f"{entry.get('input_sizes')} -> {entry.get('output_sizes')}"


def _group_label(process_group: list) -> str:
    name, desc = process_group[0], process_group[1] if len(process_group) > 1 else ""
    return f"{name} ({desc})" if desc and desc != "undefined" else name
