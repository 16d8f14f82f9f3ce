"""How TitanStrategy starts its ranks and hears of their failures: Lightning's launcher (rank 0
starts ranks 1..n-1 as copies of its command), whose watch over the ranks it started says in one
line which rank died, how, and where its output went, then stops every rank; and the settings of
the process groups that the watchdog (parallel/watchdog.py) and the heartbeat (parallel/heartbeat.py)
work with: a module's ``job.comm`` (the recipes: torchtitan's timeouts), or for a LightningModule
without a job the strategy's ``timeout`` (Lightning's, 30 minutes by default), which then governs
the hang watchdog and, with a backstop, the process groups."""

import os
import signal
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from titan_lightning._compat import ChildProcessObserver as _ChildProcessObserver
from titan_lightning._compat import SubprocessScriptLauncher as _SubprocessScriptLauncher
from titan_lightning._compat import set_num_threads_if_needed as _set_num_threads_if_needed
from titan_lightning.config import CommConfig
from titan_lightning.parallel.heartbeat import Heartbeat, error, output_target
from titan_lightning.parallel.watchdog import Watchdog, process_group_timeout, restore_environment, set_comm_environment


class _Launcher(_SubprocessScriptLauncher):
    """Lightning's launcher (rank 0 starts ranks 1..n-1 as copies of its command), whose watch over
    the ranks it started says in one line which rank died, how, and where its output went."""

    def launch(self, function, *args: Any, trainer: Optional[L.Trainer] = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            self._observer = _RankObserver(main_pid=os.getpid(), child_processes=self.procs, sleep_period=1)
            self._observer.first_rank = self.cluster_environment.node_rank() * self.num_processes + 1
            self._observer.progress_bar = trainer is not None and _progress_bar(trainer)
            self._observer.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def kill(self, signum) -> None:
        # Rank 0 is failing and stops the others itself: their exit is no news to report.
        stop_watching(self)
        super().kill(signum)


class _RankObserver(_ChildProcessObserver):
    first_rank = 1  # the global rank of the first process it watches (local rank 1 of this node)
    stopped = False  # set when rank 0 itself stops the ranks (it failed, or was interrupted)
    progress_bar = False  # rank 0 draws one: the error starts a line of its own

    def _run(self) -> bool:
        if self.stopped:
            return True
        for proc in self._child_processes:
            proc.poll()
        if all(proc.returncode == 0 for proc in self._child_processes):
            return True
        for rank, proc in enumerate(self._child_processes, start=self.first_rank):
            if proc.returncode and not self.stopped:
                code = proc.returncode
                how = (f"was killed by {signal.Signals(-code).name} (the out-of-memory killer, a scheduler or a user)"
                       if code < 0 else f"exited with status {code} (its error is above)")
                error(f"rank {rank} (pid {proc.pid}) {how}; its output: {output_target()}; stopping every rank",
                      fresh_line=self.progress_bar)
                self._terminate_all()
                return True
        return False

    def _terminate_all(self) -> None:
        for proc in self._child_processes:
            proc.send_signal(self._termination_signal)
        os._exit(1)  # this (rank 0's) process too, with a failure status rather than a kill signal


def launcher(strategy_launcher: Any, cluster_environment: Any, num_processes: int, num_nodes: int) -> Any:
    """The launcher Lightning chose, or ours where it chose its subprocess-script launcher."""
    if isinstance(strategy_launcher, _SubprocessScriptLauncher):
        return _Launcher(cluster_environment, num_processes, num_nodes)
    return strategy_launcher


def stop_watching(launcher: Any) -> None:
    """Rank 0 (or the watchdog, which names a hung rank itself) stops the ranks: their exit is no news."""
    if getattr(launcher, "_observer", None) is not None:
        launcher._observer.stopped = True


@dataclass
class Comm:
    """A run's process-group settings: ``comm``, what the hang verdict calls its two timeouts, the
    process groups' own timeout, where a hang's traces go, and the environment they replaced."""

    comm: CommConfig
    fields: tuple[str, str]
    timeout: timedelta
    traces: Path
    replaced: dict[str, Optional[str]]


def set_comm(module: L.LightningModule, backend: str, timeout: Optional[timedelta], owner: str) -> Comm:
    """Before the process group starts: the settings of the module's ``job.comm`` (a ``timeout``
    passed to the strategy replaces only the process groups' backstop) or, without a job, of the
    strategy's ``timeout`` (the watchdog's timeouts; the backstop comes ``BACKSTOP_S`` later), and
    their environment for ``backend`` (``restore_comm`` puts it back)."""
    job = getattr(module, "job", None)
    try:
        root = Path(module.trainer.default_root_dir)
    except (RuntimeError, AttributeError):  # not attached to a Trainer (or no module yet)
        root = Path.cwd()
    if job is not None:
        comm, fields = job.comm, ("comm.init_timeout_s", "comm.train_timeout_s")
        pg_timeout = process_group_timeout(comm) if timeout in (None, default_pg_timeout) else timeout
    else:
        seconds = (timeout or default_pg_timeout).total_seconds()
        comm, fields = replace(CommConfig(), init_timeout_s=seconds, train_timeout_s=seconds), (f"{owner}.timeout",) * 2
        pg_timeout = process_group_timeout(comm)
    traces = root / "comm_traces"
    return Comm(comm, fields, pg_timeout, traces, set_comm_environment(comm, traces, backend))


def restore_comm(comm: Optional[Comm]) -> None:
    """The run is over: the environment as ``set_comm`` found it."""
    if comm is not None:
        restore_environment(comm.replaced)


def watch(module: L.LightningModule, comm: Comm, *, ignore: list,
          launcher: Callable[[], Any]) -> tuple[Optional[Heartbeat], Optional[Watchdog]]:
    """Once the process group is up: the heartbeat, which names a rank that dies
    (parallel/heartbeat.py), and the watchdog, which names a hung rank (parallel/watchdog.py) and
    makes every rank leave (no news for ``launcher()``'s watch); None where they cannot run."""
    try:
        bar = _progress_bar(module.trainer)
    except RuntimeError:  # not attached to a Trainer
        bar = False
    heartbeat = Heartbeat.from_env(comm.comm.heartbeat_timeout_s, progress_bar=bar)
    return heartbeat, Watchdog.from_env(comm.comm, comm.traces, steps=lambda: module.trainer.global_step,
                                        ignore=ignore, on_hang=lambda: stop_watching(launcher()),
                                        fields=comm.fields, progress_bar=bar)


def _progress_bar(trainer: L.Trainer) -> bool:
    """Whether the run draws a progress bar (rank 0's, on the screen the ranks may share)."""
    bar = trainer.progress_bar_callback
    return bar is not None and bool(bar.is_enabled)


def stop_watch(heartbeat: Optional[Heartbeat], watchdog: Optional[Watchdog], *, failed: bool) -> None:
    """The run ended, or ``failed``: no thread of ours outlives it (after a failure, the heartbeat's
    ``explain()`` still names a rank that died)."""
    if watchdog is not None:
        watchdog.stop()
    if heartbeat is not None:
        heartbeat.stop(failed=failed)
