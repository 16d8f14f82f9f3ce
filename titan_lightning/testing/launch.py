"""Run a ``titan-lightning`` command on N real processes, torchrun-style, and never hang.

Lightning's own launcher re-executes ``sys.argv``, which inside pytest is pytest. Here each
rank is a ``python -m titan_lightning.testing.worker`` process of its own, in its own
session, with the environment torchrun would give it. ``TORCHELASTIC_RUN_ID`` makes
Lightning pick ``TorchElasticEnvironment``: the processes are external (nothing is spawned),
rank and world size come from ``RANK`` and ``WORLD_SIZE``, and ``devices * num_nodes`` must
equal ``WORLD_SIZE``.

When a rank fails the others are killed at once (they would wait in a collective forever);
when the timeout passes all are killed, after each has printed its Python stacks.
"""

import getpass
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

WORKER = "titan_lightning.testing.worker"
# Torch threads per rank (default 1: the test machines have 2 cores shared by up to 8 ranks).
THREADS_ENV = "TITAN_LIGHTNING_WORKER_THREADS"
TAIL_LINES = 50
# CPU kernel paths pinned so golden numbers hold on every x86 CPU with AVX2 (the hardware
# class "cpu"): ATen's vectorized kernels, MKL (conditional numerical reproducibility) and
# oneDNN otherwise pick AVX-512 or AMX code where the CPU has it, which sums in another
# order. Each library reads its variable when it starts, so they must be in the environment
# before torch computes anything: set for every launched rank, and by tests/conftest.py.
PORTABLE_CPU_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_POLL_S = 0.05
_STACK_DUMP_S = 0.5  # time given to hung ranks to print their stacks before SIGKILL
_LAUNCH_ENV = "TITAN_LIGHTNING_LAUNCH_ID"  # marks the processes of one launch_nodes call


@dataclass(kw_only=True)
class LaunchResult:
    """What the ranks of one launch left behind: exit codes, ``rank{r}.json`` and logs."""

    argv: list[str]
    world_size: int
    out_dir: Path
    pids: list[int]
    returncodes: list[Optional[int]]
    # The parsed rank{r}.json of each rank; None where a rank wrote none.
    ranks: list[Optional[dict]]

    def log(self, rank: int) -> str:
        path = self.out_dir / f"rank{rank}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, rank: int, lines: int = TAIL_LINES) -> str:
        return "\n".join(self.log(rank).splitlines()[-lines:])

    def log_tails(self, ranks: Optional[list[int]] = None, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` of each rank's log (all ranks by default), each under a header."""
        ranks = range(self.world_size) if ranks is None else ranks
        return "\n".join(
            f"--- rank {rank} (exit {self.returncodes[rank]}), last {lines} lines of "
            f"{self.out_dir / f'rank{rank}.log'} ---\n{self.log_tail(rank, lines)}"
            for rank in ranks
        )


class LaunchError(Exception):
    """A launch that did not succeed; ``result`` holds the pids, exit codes and logs."""

    def __init__(self, message: str, result: LaunchResult) -> None:
        super().__init__(message)
        self.result = result


class LaunchFailed(LaunchError, RuntimeError):
    """A rank exited with a non-zero status; the other ranks were killed."""


class LaunchTimeout(LaunchError, TimeoutError):
    """The ranks did not all finish in time; all were killed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pythonpath_env(*folders) -> dict[str, str]:
    """``{"PYTHONPATH": ...}`` with ``folders`` before this process's PYTHONPATH entries: what a
    subprocess needs to import, by name, modules of those folders (a test's own recipes or cases)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [*map(str, folders), os.environ.get("PYTHONPATH")]))}


def rank_env(rank: int, world_size: int, *, port: int, out_dir: Path, env: Optional[dict] = None) -> dict[str, str]:
    """The environment of one rank: this process's, the test defaults, ``env``, then the rank's variables.

    Test defaults (``env`` may override them): no CUDA, unbuffered output, one torch thread,
    CPU kernels pinned to AVX2 (``PORTABLE_CPU_ENV``: goldens hold across x86 CPUs), and
    one run folder under ``out_dir`` for all ranks. The rank's variables always win.
    """
    from titan_lightning.trainer import RUN_DIR_ENV  # here: importing the launcher costs no torch/lightning

    ranks = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "NODE_RANK": "0",
        "TORCHELASTIC_RUN_ID": f"titan-lightning-{port}",
    }
    return {**launch_env({RUN_DIR_ENV: str(out_dir / "run"), **(env or {})}), **ranks}


def portable_cpu_env(environ: Optional[dict] = None) -> dict[str, str]:
    """``PORTABLE_CPU_ENV`` where ``environ`` (default: this process's) sets no other value, and
    Inductor's cache in a folder of the pinned vector ISA's own (unless ``environ`` names one).

    Inductor writes its C++ kernels for the ISA ``ATEN_CPU_CAPABILITY`` picks, but its FX graph
    cache does not key on it (torch 2.11-2.13): a process without the pin (a user's run, a script)
    then loads a kernel written for AVX2 and rebuilds it with AVX-512's flags, whose vectors are
    twice as wide as its buffers: heap corruption (``free(): invalid pointer``, ``malloc():
    unaligned tcache chunk``) or wrong values, seen with compiled QLoRA blocks. Pinned processes
    keep their kernels apart."""
    environ = os.environ if environ is None else environ
    pinned = {key: environ.get(key, value) for key, value in PORTABLE_CPU_ENV.items()}
    try:
        user = "".join(c if c.isalnum() else "_" for c in getpass.getuser())
    except (KeyError, OSError):  # (a container's uid without a name)
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    folder = f"torchinductor_{user}_{pinned['ATEN_CPU_CAPABILITY'] or 'default'}"
    return {**pinned, INDUCTOR_CACHE_ENV: environ.get(INDUCTOR_CACHE_ENV, os.path.join(tempfile.gettempdir(), folder))}


def launch_env(env: Optional[dict] = None) -> dict[str, str]:
    """This process's environment without ``TORCHELASTIC_*`` leftovers, the test defaults, then ``env``.

    The defaults: no CUDA, unbuffered output, faulthandler on, one torch thread (``THREADS_ENV``), CPU kernels
    pinned to AVX2 (``PORTABLE_CPU_ENV``) and gloo on the loopback interface.
    """
    base = {key: value for key, value in os.environ.items() if not key.startswith("TORCHELASTIC_")}
    threads = (env or {}).get(THREADS_ENV, os.environ.get(THREADS_ENV, "1"))
    defaults = {
        **portable_cpu_env(),
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONUNBUFFERED": "1",
        # A rank that dies of a fatal signal (SIGSEGV, SIGABRT...) prints every thread's Python stack into its
        # log first (once seen: a rank 0 exiting -11 mid-step on a loaded 2-core host, no trace left).
        "PYTHONFAULTHANDLER": "1",
        THREADS_ENV: threads,
        "OMP_NUM_THREADS": threads,  # also keeps Lightning from choosing a thread count itself
    }
    if os.path.exists("/sys/class/net/lo"):
        defaults["GLOO_SOCKET_IFNAME"] = "lo"  # all ranks are local; do not trust the hostname's address
    env = env or {}
    if env.get("ATEN_CPU_CAPABILITY", defaults["ATEN_CPU_CAPABILITY"]) != defaults["ATEN_CPU_CAPABILITY"]:
        # (a rank pinned otherwise than this process keeps its kernels in that ISA's own folder)
        defaults[INDUCTOR_CACHE_ENV] = portable_cpu_env(env)[INDUCTOR_CACHE_ENV]
    return {**base, **defaults, **env}


def launch(
    argv: list[str],
    world_size: int,
    *,
    out_dir: Path,
    timeout: float,
    env: Optional[dict] = None,
    worker_options: Optional[list[str]] = None,
    cwd: Optional[Path] = None,
    module: str = WORKER,
) -> LaunchResult:
    """Run ``titan-lightning *argv`` on ``world_size`` processes; each writes ``out_dir/rank{r}.{json,log}``.

    Raises ``LaunchFailed`` (a RuntimeError) when a rank exits non-zero and ``LaunchTimeout``
    (a TimeoutError) when they are not all done after ``timeout`` seconds; both carry the
    tails of the logs. No process of the launch outlives this call, whatever happens.
    ``worker_options`` go to the worker before ``--`` (golden numerics, seed checkpoint);
    ``cwd`` is the ranks' working directory (another checkout's code, for loss compare).
    ``module`` is what each rank runs (``python -m module --out DIR [options] -- argv``):
    the CLI worker, or ``titan_lightning.testing.spawn`` to run a plain function.
    A launch whose rendezvous port was taken before rank 0 bound it is started again on another
    port (``_on_a_free_port``).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    return _on_a_free_port(lambda port: _launch_once(argv, world_size, port, out_dir=out_dir, timeout=timeout,
                                                     env=env, worker_options=worker_options, cwd=cwd, module=module))


def _launch_once(argv: list[str], world_size: int, port: int, *, out_dir: Path, timeout: float, env: Optional[dict],
                 worker_options: Optional[list[str]], cwd: Optional[Path], module: str) -> LaunchResult:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):
        for suffix in ("json", "error", "log"):
            (out_dir / f"rank{rank}.{suffix}").unlink(missing_ok=True)
    command = [sys.executable, "-m", module, "--out", str(out_dir), *(worker_options or []), "--", *argv]
    envs = [rank_env(rank, world_size, port=port, out_dir=out_dir, env=env) for rank in range(world_size)]
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + timeout
    try:
        for rank in range(world_size):
            with open(out_dir / f"rank{rank}.log", "wb") as log:  # the child keeps its own descriptor
                forked = _fork_server().start(command[2:], envs[rank], out_dir / f"rank{rank}.log") if cwd is None else None
                procs.append(forked or subprocess.Popen(
                    command, env=envs[rank], cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                ))
        failed, running = _wait(procs, deadline)
        if running:
            _dump_stacks([procs[rank] for rank in running])
    finally:
        _kill(procs)
    result = LaunchResult(
        argv=list(argv), world_size=world_size, out_dir=out_dir, pids=[p.pid for p in procs],
        returncodes=[p.returncode for p in procs],
        ranks=[_read_json(out_dir / f"rank{rank}.json") for rank in range(world_size)],
    )
    codes = ", ".join(f"rank {r} exited {result.returncodes[r]}" for r in failed)
    _raise_unless_done(result, f"{world_size} rank(s)", "rank", timeout, running, failed, codes, failed)
    return result


def run_single(
    argv: list[str], *, out_dir: Path, timeout: float, env: Optional[dict] = None,
    worker_options: Optional[list[str]] = None,
) -> LaunchResult:
    """The single-process reference run of ``argv``."""
    return launch(argv, 1, out_dir=out_dir, timeout=timeout, env=env, worker_options=worker_options)


@dataclass(kw_only=True)
class NodesLaunchResult(LaunchResult):
    """What a multi-node launch left behind: ``pids`` and ``returncodes`` are the node launchers'
    (one per node), ``ranks`` one per global rank, read from ``out_dir/node{n}/rank{r}.json``.
    A rank's log is its node's launcher log, ``out_dir/node{n}.log`` (its local ranks interleaved)."""

    nproc_per_node: int

    def node_log(self, node: int) -> Path:
        return self.out_dir / f"node{node}.log"

    def log(self, rank: int) -> str:
        path = self.node_log(rank // self.nproc_per_node)
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tails(self, ranks: Optional[list[int]] = None, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` of the log of each node holding one of ``ranks`` (all by default)."""
        ranks = range(self.world_size) if ranks is None else ranks
        nodes = sorted({rank // self.nproc_per_node for rank in ranks})
        return "\n".join(
            f"--- node {node} (launcher exit {self.returncodes[node]}), last {lines} lines of "
            f"{self.node_log(node)} ---\n{self.log_tail(node * self.nproc_per_node, lines)}"
            for node in nodes
        )


def launch_nodes(
    argv: list[str],
    nnodes: int,
    nproc_per_node: int,
    *,
    out_dir: Path,
    timeout: float,
    env: Optional[dict] = None,
) -> NodesLaunchResult:
    """Run ``titan-lightning *argv`` as ``nnodes`` torchrun launchers on this machine, as on ``nnodes`` machines.

    Node ``n`` runs ``torchrun --nnodes N --nproc-per-node P --node-rank n --master-addr 127.0.0.1
    --master-port PORT -m titan_lightning.testing.worker --out out_dir/node{n} -- argv`` in
    ``out_dir/node{n}``, its own working directory as on another machine, so rank ``r`` writes
    ``out_dir/node{r // P}/rank{r}.json``, and its run folder defaults to ``out_dir/node{n}/run``
    (``env`` may name one folder for all). Errors and the no-survivor promise are ``launch``'s: when a
    launcher exits non-zero or ``timeout`` passes, every launcher and every rank it started is killed
    (torchrun starts each rank in a session of its own: the ranks are found by a variable only this
    launch's processes carry, even a rank whose launcher died first).
    """
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nnodes={nnodes} and nproc_per_node={nproc_per_node} must be >= 1")
    return _on_a_free_port(lambda port: _launch_nodes_once(argv, nnodes, nproc_per_node, port, out_dir=out_dir,
                                                           timeout=timeout, env=env))


def _launch_nodes_once(argv: list[str], nnodes: int, nproc_per_node: int, port: int, *, out_dir: Path,
                       timeout: float, env: Optional[dict]) -> NodesLaunchResult:
    """``launch_nodes`` with one port."""
    from titan_lightning.trainer import RUN_DIR_ENV  # here: importing the launcher costs no torch/lightning

    out_dir = Path(out_dir)
    world_size = nnodes * nproc_per_node
    base = launch_env(env)
    if RUN_DIR_ENV not in (env or {}):
        base.pop(RUN_DIR_ENV, None)
    base[_LAUNCH_ENV] = f"{os.getpid()}-{port}-{time.time_ns()}"
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + timeout
    running: list[int] = []
    try:
        for node in range(nnodes):
            folder = out_dir / f"node{node}"
            folder.mkdir(parents=True, exist_ok=True)
            for stale in [*folder.glob("rank*.json"), *folder.glob("rank*.error")]:
                stale.unlink()
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                "--nproc-per-node", str(nproc_per_node), "--node-rank", str(node),
                "--master-addr", "127.0.0.1", "--master-port", str(port),
                "-m", WORKER, "--out", str(folder), "--", *argv,
            ]
            with open(out_dir / f"node{node}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    command, env=base, cwd=folder, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                ))
        failed, running = _wait(procs, deadline)
        launchers = {proc.pid for proc in procs}
        if running:
            for pid in set(_carrying(_LAUNCH_ENV, base[_LAUNCH_ENV])) - launchers:
                _signal(pid, signal.SIGUSR1, group=False)  # the ranks print their stacks into the node logs
            time.sleep(_STACK_DUMP_S)
    finally:
        _kill(procs)
        for pid in _carrying(_LAUNCH_ENV, base[_LAUNCH_ENV]):
            _signal(pid, signal.SIGKILL, group=True)
            _signal(pid, signal.SIGKILL, group=False)
    result = NodesLaunchResult(
        argv=list(argv), world_size=world_size, out_dir=out_dir, nproc_per_node=nproc_per_node,
        pids=[p.pid for p in procs], returncodes=[p.returncode for p in procs],
        ranks=[_read_json(out_dir / f"node{r // nproc_per_node}" / f"rank{r}.json") for r in range(world_size)],
    )
    codes = ", ".join(f"node {n}'s torchrun exited {result.returncodes[n]}" for n in failed)
    _raise_unless_done(result, f"{nnodes} node(s) x {nproc_per_node}", "node", timeout, running, failed, codes,
                       [n * nproc_per_node for n in failed])
    return result


# The rendezvous store's server could not bind its port (another process took it after ``free_port``).
_PORT_TAKEN = "EADDRINUSE"
PORT_ATTEMPTS = 3


def _on_a_free_port(attempt: Callable[[int], LaunchResult]) -> LaunchResult:
    """``attempt(port)`` on a port ``free_port`` found, again on another one (at most PORT_ATTEMPTS
    in all) when it failed because the port was taken before rank 0's store bound it: free a
    moment before, another process (a launch beside this one) may have bound it since. Rank 0 fails
    so at its start, before any work; every process of the attempt is gone when it returns."""
    for tries in range(1, PORT_ATTEMPTS):
        try:
            return attempt(free_port())
        except LaunchFailed as failure:
            result = failure.result
            if not any(_PORT_TAKEN in result.log(rank) for rank in range(result.world_size)):
                raise
            warnings.warn(f"the rendezvous port was taken by another process; launching again (retry {tries} of "
                          f"{PORT_ATTEMPTS - 1})")
    return attempt(free_port())


def _raise_unless_done(result: LaunchResult, where: str, unit: str, timeout: float, running: list[int],
                       failed: list[int], codes: str, failed_ranks: list[int]) -> None:
    """LaunchTimeout if ``running`` ``unit``s (ranks or nodes) remain, else LaunchFailed if any ``failed``."""
    shown = " ".join(result.argv)
    if running:
        raise LaunchTimeout(
            f"`{shown}` on {where} did not finish within timeout={timeout} s; "
            f"{unit}s {running} were still running and were killed\n{result.log_tails()}",
            result,
        )
    if failed:
        raise LaunchFailed(
            f"`{shown}` on {where} failed ({codes}); the other {unit}s were killed\n{result.log_tails(failed_ranks)}",
            result,
        )


def _wait(procs: list[subprocess.Popen], deadline: float) -> tuple[list[int], list[int]]:
    """Poll until all exit 0, one exits non-zero, or the deadline; return (failed, running) ranks."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        running = [rank for rank, code in enumerate(codes) if code is None]
        if failed or not running:
            return failed, []
        if time.monotonic() >= deadline:
            return [], running
        time.sleep(_POLL_S)


def _dump_stacks(procs: list[subprocess.Popen]) -> None:
    # The worker registers faulthandler on SIGUSR1; one still importing simply dies of it.
    for proc in procs:
        _signal(proc.pid, signal.SIGUSR1, group=False)
    time.sleep(_STACK_DUMP_S)


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every rank and its process group (leftover children too) and reap the ranks.

    The rank itself first: a rank forked by the server makes its own group (``setsid``) only
    once it runs, so one killed right after it started has no group yet, and a group kill alone
    missed it (seen: an interrupted launch waiting forever for a rank stuck in rendezvous)."""
    for proc in procs:
        _signal(proc.pid, signal.SIGKILL, group=False)
        _signal(proc.pid, signal.SIGKILL, group=True)
    for proc in procs:
        proc.wait()


def _carrying(name: str, value: str) -> list[int]:
    """The processes started with ``name=value`` in their environment (Linux /proc; elsewhere none)."""
    entry = f"{name}={value}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if entry in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue  # gone, or another user's
    return found


def _signal(pid: int, sig: int, *, group: bool) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone (PermissionError: macOS answers so for a group of zombies)


def _read_json(path: Path) -> Optional[dict]:
    if not path.exists():
        return None
    with open(path) as f:
        return json.load(f)


# -- the fork server (titan_lightning/testing/zygote.py) ------------------------------------------

FORK_SERVER_ENV = "TITAN_LIGHTNING_FORK_SERVER"  # "0": every rank a fresh interpreter
# Read by the interpreter, torch or its libraries when they load: a rank that needs other values
# than the server's gets a fresh interpreter.
_IMPORT_TIME_ENV = (*PORTABLE_CPU_ENV, "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONOPTIMIZE", "PYTHONDEVMODE")
_SERVER_START_S = 180.0


class _Forked:
    """A rank forked by the server, with the part of Popen's interface launch uses."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.conn, self.pid = conn, pid
        self.returncode: Optional[int] = None
        self._buffer = b""

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.conn.setblocking(False)
            try:
                self._feed(self.conn.recv(4096))
            except BlockingIOError:
                pass
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.conn.setblocking(True)
        while self.returncode is None:
            self._feed(self.conn.recv(4096))
        return self.returncode

    def _feed(self, data: bytes) -> None:
        if not data:  # the server is gone: the rank with it (killpg'ed by launch), status unknown
            self.returncode = -signal.SIGKILL
        else:
            self._buffer += data
            if not self._buffer.endswith(b"\n"):
                return
            self.returncode = json.loads(self._buffer)["exit"]
        self.conn.close()


class _ForkServer:
    """The server process of this test process, started at the first launch; ``start`` returns
    None (the caller starts a fresh interpreter) when it is off, failed to start, or the rank's
    environment needs a fresh interpreter."""

    def __init__(self) -> None:
        import atexit

        self.env = launch_env(None)
        self.pid = os.getpid()  # (a forked copy of this process starts its own)
        self.proc: Optional[subprocess.Popen] = None
        if os.environ.get(FORK_SERVER_ENV, "1") == "0" or not hasattr(os, "fork") or not hasattr(socket, "AF_UNIX"):
            return
        self.folder = tempfile.mkdtemp(prefix="titan-zygote-")
        self.path = os.path.join(self.folder, "socket")
        self.log = open(os.path.join(self.folder, "server.log"), "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "titan_lightning.testing.zygote", self.path], env=self.env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log,
                                     start_new_session=True)
        atexit.register(self.stop)
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], _SERVER_START_S)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            print(f"titan_lightning.testing.launch: the fork server did not start ({line.strip()!r}; "
                  f"{os.path.join(self.folder, 'server.log')}); every rank is a fresh interpreter", file=sys.stderr)
            self.stop()

    def start(self, args: list[str], env: dict[str, str], log: Path) -> Optional[_Forked]:
        if self.proc is None or self.proc.poll() is not None:
            return None
        if any(env.get(key) != self.env.get(key) for key in _IMPORT_TIME_ENV):
            return None
        module, rest = args[0], args[1:]
        request = {"module": module, "args": rest, "env": env, "cwd": os.getcwd(), "log": str(log)}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(60)
            conn.connect(self.path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    raise ConnectionError("the fork server closed the connection")
                answer += chunk
        except OSError as error:
            conn.close()
            print(f"titan_lightning.testing.launch: the fork server failed ({error}); a fresh interpreter instead",
                  file=sys.stderr)
            self.stop()
            return None
        return _Forked(conn, json.loads(answer)["pid"])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


_SERVER: Optional[_ForkServer] = None
_SERVER_LOCK = threading.Lock()


def _fork_server() -> _ForkServer:
    """This process's fork server (started at the first call; launches may run in threads)."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or _SERVER.pid != os.getpid():
            _SERVER = _ForkServer()
        return _SERVER
