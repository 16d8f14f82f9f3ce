"""A fork server for test ranks: torch, Lightning and titan_lightning imported once, each rank forked.

A fresh ``python -m titan_lightning.testing.worker`` spends ~4-5 s of CPU importing torch and
Lightning before it does anything; the test suite starts a few hundred ranks, up to 8 at a time
on 2 cores. This server imports them once; ``launch`` asks it for each rank and gets a process
that starts in milliseconds and behaves as the fresh one would:

- its own session (``setsid``), so ``killpg`` reaches it and its children;
- exactly the environment, working directory, stdin (/dev/null) and log file it asked for;
  ``PYTHONPATH`` entries are put on ``sys.path`` (a test module next to its test);
- ``python -m MODULE ARGS`` semantics (``runpy``, ``sys.argv``), exit status as a Popen's
  (negative for a signal).

What a fresh interpreter reads from the environment at import time cannot change after the
fork: the server is started with the launcher's defaults (``PORTABLE_CPU_ENV``), and
``launch`` starts a fresh interpreter for any rank whose environment differs in those
variables, or that runs with another working directory (another checkout's code).
Lightning's rank-zero flag, computed at import, is recomputed in the child.

Protocol (a Unix socket, one connection per rank, JSON lines): the client sends
``{"module", "args", "env", "cwd", "log"}``; the server answers ``{"pid": N}`` once forked and
``{"exit": CODE}`` when the rank ended. The server is single-threaded (``select`` over the
socket, the connections and SIGCHLD's wakeup pipe: forking from a threaded process is unsafe)
and exits when its parent (the test process) is gone. Besides the imports it tokenizes the shipped
corpus once (``tokenized_splits`` keeps it), which most test runs train on.

    python -m titan_lightning.testing.zygote SOCKET_PATH
"""

import json
import os
import select
import signal
import socket
import sys
import traceback

from titan_lightning.config import DataConfig
from titan_lightning.data.datamodule import tokenized_splits
from titan_lightning.data.tokenizer import CORPUS_PATH, load_tokenizer

PRELOAD = ("torch", "torch.distributed", "lightning", "titan_lightning.cli", "titan_lightning.testing.worker",
           "titan_lightning.testing.spawn")


def main(path: str) -> None:
    import importlib
    import threading

    for name in PRELOAD:
        importlib.import_module(name)
    _tokenize_shipped_corpus()
    if threading.active_count() != 1:
        print(f"not ready: {threading.active_count()} threads after the imports", flush=True)
        os._exit(1)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (a handler, so the wakeup fd hears it)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    pending: dict[socket.socket, bytes] = {}
    while True:
        readable, _, _ = select.select([listener, wake_read, *pending], [], [], 1.0)
        if os.getppid() != parent:
            os._exit(0)  # the test process is gone
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(children)
        if listener in readable:
            conn, _ = listener.accept()
            pending[conn] = b""
        for conn in [c for c in readable if c in pending]:
            data = conn.recv(65536)
            if not data:
                pending.pop(conn).close()
                continue
            pending[conn] += data
            if not pending[conn].endswith(b"\n"):
                continue
            request = json.loads(pending.pop(conn))
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in [*children.values(), *pending]:
                    other.close()
                conn.close()
                os.close(wake_read)
                os.close(wake_write)
                _child(request)  # never returns
            children[pid] = conn
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _reap(children)


def _tokenize_shipped_corpus() -> None:
    """Most test runs train on the shipped corpus: tokenized here once, each forked rank finds it in
    ``tokenized_splits``'s memo. Sequentially (``TOKENIZERS_PARALLELISM=false``): a thread pool of
    the tokenizers library started here would be unusable after the fork."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        tokenized_splits(CORPUS_PATH, None, DataConfig().val_fraction, load_tokenizer)
    except (OSError, ValueError) as error:  # the assets are missing: the ranks report it themselves
        print(f"the shipped corpus is not tokenized ahead: {error}", file=sys.stderr, flush=True)
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass  # the client is gone
            conn.close()


def _child(request: dict) -> None:
    """Become ``python -m module args`` in the requested environment; exit with its status."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(devnull)
        os.close(log)
        if request["env"].get("PYTHONFAULTHANDLER"):  # (read by a fresh interpreter at its start)
            import faulthandler

            faulthandler.enable(all_threads=True)
        for entry in reversed([e for e in request["env"].get("PYTHONPATH", "").split(os.pathsep) if e]):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        if request["cwd"] not in sys.path:
            sys.path.insert(0, request["cwd"])  # as `python -m` puts the working directory first
        from lightning_utilities.core.rank_zero import rank_zero_only

        from titan_lightning._compat import lightning_rank  # (after sys.path is the request's)

        rank_zero_only.rank = lightning_rank()  # computed at import, from the server's environment
        import random

        random.seed()
        import runpy

        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        traceback.print_exc()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1])
