"""How TitanStrategy starts its ranks and hears of their failures: Lightning's launcher (rank 0
starts ranks 1..n-1 as copies of its command), whose watch over the ranks it started says in one
line which rank died, how, and where its output went, then stops every rank; and the settings of
the process groups (``job.comm``: timeouts, where a hang's traces go) that the watchdog
(parallel/watchdog.py) and the heartbeat (parallel/heartbeat.py) work with."""

import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L

from titan_lightning._compat import ChildProcessObserver as _ChildProcessObserver
from titan_lightning._compat import SubprocessScriptLauncher as _SubprocessScriptLauncher
from titan_lightning._compat import set_num_threads_if_needed as _set_num_threads_if_needed
from titan_lightning.config import CommConfig
from titan_lightning.parallel.heartbeat import Heartbeat, output_target
from titan_lightning.parallel.watchdog import Watchdog, set_comm_environment


class _Launcher(_SubprocessScriptLauncher):
    """Lightning's launcher (rank 0 starts ranks 1..n-1 as copies of its command), whose watch over
    the ranks it started says in one line which rank died, how, and where its output went."""

    def launch(self, function, *args: Any, trainer: Optional[L.Trainer] = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            self._observer = _RankObserver(main_pid=os.getpid(), child_processes=self.procs, sleep_period=1)
            self._observer.first_rank = self.cluster_environment.node_rank() * self.num_processes + 1
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
                print(f"titan-lightning: error: rank {rank} (pid {proc.pid}) {how}; its output: {output_target()}; "
                      f"stopping every rank", file=sys.stderr, flush=True)
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


def set_comm(module: L.LightningModule, backend: str) -> tuple[CommConfig, Path]:
    """Before the process group starts: the environment of the module's ``job.comm`` (torchtitan's
    defaults without a job) for ``backend``; returns it and where a hang's traces go."""
    job = getattr(module, "job", None)
    try:
        root = Path(module.trainer.default_root_dir)
    except RuntimeError:  # not attached to a Trainer
        root = Path.cwd()
    comm, traces = (job.comm if job is not None else CommConfig()), root / "comm_traces"
    set_comm_environment(comm, traces, backend)
    return comm, traces


def watch(module: L.LightningModule, comm: CommConfig, traces: Path, *, ignore: list,
          launcher: Callable[[], Any]) -> tuple[Optional[Heartbeat], Optional[Watchdog]]:
    """Once the process group is up: the heartbeat, which names a rank that dies
    (parallel/heartbeat.py), and the watchdog, which names a hung rank (parallel/watchdog.py) and
    makes every rank leave (no news for ``launcher()``'s watch); None where they cannot run."""
    heartbeat = Heartbeat.from_env()
    return heartbeat, Watchdog.from_env(comm, traces, steps=lambda: module.trainer.global_step, ignore=ignore,
                                        on_hang=lambda: stop_watching(launcher()))


def stop_watch(heartbeat: Optional[Heartbeat], watchdog: Optional[Watchdog], *, failed: bool) -> None:
    if heartbeat is not None and not failed:
        heartbeat.stop()  # (after a failure it beats on: the peers are told who really died)
    if watchdog is not None:
        watchdog.stop()
