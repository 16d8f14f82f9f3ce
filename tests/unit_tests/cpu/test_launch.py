"""Real multi-process runs (gloo on CPU) started one process per rank, torchrun-style, that never hang."""

import importlib
import math
import os
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from titan_lightning.data.tokenizer import CORPUS_PATH
from titan_lightning.testing import LaunchFailed, LaunchTimeout, launch, rank_env, run_single
from titan_lightning.testing.launch import portable_cpu_env, pythonpath_env

launch_module = importlib.import_module("titan_lightning.testing.launch")  # the package's `launch` is the function

FIT = ["fit", "--recipe", "recipes.tests.features:llama3_debugmodel", "--trainer.max_steps", "3"]
FIT += ["--trainer.accelerator", "cpu"]

# Recipes only these tests need, importable by the workers through PYTHONPATH.
BROKEN_RECIPES = textwrap.dedent("""
    import os
    import time

    from recipes.tests.features import llama3_debugmodel

    def fails_on_rank_1():
        if os.environ["RANK"] == "1":
            raise RuntimeError("rank 1 fails on purpose")
        return llama3_debugmodel()

    def hangs_on_rank_1():
        if os.environ["RANK"] == "1":
            time.sleep(3600)
        return llama3_debugmodel()

    def segfaults_on_rank_1():
        if os.environ["RANK"] == "1":
            import ctypes

            ctypes.string_at(0)  # reads address 0: SIGSEGV
        return llama3_debugmodel()
""")


@pytest.fixture
def launch_broken(tmp_path):
    """Launch two ranks of ``fit`` on a recipe of BROKEN_RECIPES."""
    folder = tmp_path / "recipes_path"
    folder.mkdir()
    (folder / "broken_recipes.py").write_text(BROKEN_RECIPES)
    env = pythonpath_env(folder)

    def launch_recipe(name, *, timeout):
        argv = ["fit", "--recipe", f"broken_recipes:{name}", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
        return launch(argv, 2, out_dir=tmp_path / "out", timeout=timeout, env=env)

    return launch_recipe


def assert_all_gone(pids):
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # each rank led its own process group: nothing of it is left


def test_rank_env_is_torchrun_style_without_cuda(tmp_path):
    env = rank_env(1, 4, port=12345, out_dir=tmp_path)
    assert {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")} == {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "12345", "WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1",
        "NODE_RANK": "0",
    }
    assert env["TORCHELASTIC_RUN_ID"]  # Lightning: processes are created externally, rank from RANK
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert rank_env(0, 1, port=1, out_dir=tmp_path, env={"CUDA_VISIBLE_DEVICES": "0"})["CUDA_VISIBLE_DEVICES"] == "0"
    assert rank_env(0, 1, port=1, out_dir=tmp_path, env={"RANK": "3"})["RANK"] == "0"  # the rank's variables win


def test_pinned_processes_keep_inductors_kernels_apart_from_unpinned_ones(tmp_path):
    """Inductor writes its CPU kernels for the vector ISA ATEN_CPU_CAPABILITY picks but does not key
    its cache on it: a process pinned to AVX2 (tests, launched ranks) and one without the pin (a
    user's run: AVX-512 where the CPU has it) must not share the cache, or one loads the other's
    kernel rebuilt with its own vector width (heap corruption, seen with compiled QLoRA blocks)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    pinned = portable_cpu_env({})
    assert pinned["ATEN_CPU_CAPABILITY"] == "avx2"
    assert pinned["TORCHINDUCTOR_CACHE_DIR"] != default_cache_dir()  # (an unpinned process's)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == pinned["TORCHINDUCTOR_CACHE_DIR"]  # (this one: conftest)
    assert rank_env(0, 1, port=1, out_dir=tmp_path)["TORCHINDUCTOR_CACHE_DIR"] == pinned["TORCHINDUCTOR_CACHE_DIR"]
    other = portable_cpu_env({"ATEN_CPU_CAPABILITY": "default"})["TORCHINDUCTOR_CACHE_DIR"]
    assert other not in (pinned["TORCHINDUCTOR_CACHE_DIR"], default_cache_dir())
    unpinned = rank_env(0, 1, port=1, out_dir=tmp_path, env={"ATEN_CPU_CAPABILITY": "default"})
    assert unpinned["TORCHINDUCTOR_CACHE_DIR"] == other  # (a rank pinned otherwise: that ISA's folder)
    assert portable_cpu_env({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)


@pytest.mark.multi_process
def test_single_rank_run_records_every_step_and_reruns_are_bitwise_identical(tmp_path):
    with ThreadPoolExecutor(2) as pool:  # two launches at once: separate ports, folders and processes
        first, second = pool.map(lambda name: run_single(FIT, out_dir=tmp_path / name, timeout=120), ["a", "b"])
    rank0 = first.ranks[0]
    assert (rank0["rank"], rank0["world_size"], rank0["steps"]) == (0, 1, [1, 2, 3])
    assert all(math.isfinite(x) for x in rank0["losses"] + rank0["grad_norms"])
    assert second.ranks[0]["losses"] == rank0["losses"]
    assert second.ranks[0]["grad_norms"] == rank0["grad_norms"]
    assert_all_gone(first.pids + second.pids)


@pytest.mark.multi_process
def test_two_ranks_with_lightning_ddp_are_rank_0_and_1_of_2_and_log_the_same_synced_loss(tmp_path):
    argv = FIT + ["--trainer.strategy", "ddp", "--trainer.devices", "2"]
    result = launch(argv, 2, out_dir=tmp_path, timeout=120)
    assert result.returncodes == [0, 0]
    rank0, rank1 = result.ranks
    assert [r["rank"] for r in result.ranks] == [0, 1]
    assert [r["world_size"] for r in result.ranks] == [2, 2]
    # Detected as launched externally: neither rank spawned processes of its own.
    assert {r["strategy"] for r in result.ranks} == {"DDPStrategy"}
    assert {r["cluster_environment"] for r in result.ranks} == {"TorchElasticEnvironment"}
    assert rank0["steps"] == rank1["steps"] == [1, 2, 3]
    assert all(math.isfinite(x) for x in rank0["losses"] + rank1["losses"])
    assert rank0["losses"] == rank1["losses"]  # train/loss is logged with sync_dist=True
    assert_all_gone(result.pids)


@pytest.mark.multi_process
def test_a_failing_rank_ends_the_launch_at_once_with_its_log_and_kills_the_others(tmp_path, launch_broken):
    start = time.monotonic()
    with pytest.raises(LaunchFailed, match=r"on 2 rank\(s\) failed \(rank 1 exited 1\)") as caught:
        launch_broken("fails_on_rank_1", timeout=120)
    assert time.monotonic() - start < 60  # rank 0 waits for rank 1 forever; it was not waited for
    assert "RuntimeError: rank 1 fails on purpose" in str(caught.value)
    assert (tmp_path / "out" / "rank1.error").read_text().rstrip().endswith("RuntimeError: rank 1 fails on purpose")
    assert caught.value.result.returncodes[1] == 1
    assert_all_gone(caught.value.result.pids)


def test_a_rank_dying_of_a_fatal_signal_leaves_its_python_stack_in_its_log(launch_broken):
    with pytest.raises(LaunchFailed, match=r"failed \(rank 1 exited -11\)") as caught:
        launch_broken("segfaults_on_rank_1", timeout=120)
    log = caught.value.result.log(1)
    assert "Fatal Python error: Segmentation fault" in log
    assert 'broken_recipes.py", line' in log and "in segfaults_on_rank_1" in log  # where it died
    assert_all_gone(caught.value.result.pids)


@pytest.mark.multi_process
def test_a_hanging_rank_hits_the_timeout_shows_where_it_hangs_and_leaves_nothing_alive(launch_broken):
    start = time.monotonic()
    with pytest.raises(LaunchTimeout, match=r"did not finish within timeout=10 s") as caught:
        launch_broken("hangs_on_rank_1", timeout=10)
    assert time.monotonic() - start < 10 + 10  # the timeout, then stacks and SIGKILL: no waiting for the ranks
    message = str(caught.value)
    assert "broken_recipes:hangs_on_rank_1" in message
    # Each rank printed its stacks before it was killed (rank 1 in hangs_on_rank_1 once it got there).
    # Read whole logs: with many threads the dump is longer than the message's log tails.
    result = caught.value.result
    for rank in range(2):
        assert "in _run_module_as_main" in result.log(rank), rank  # the outermost frame of the main thread
    assert caught.value.result.returncodes == [-9, -9]
    assert isinstance(caught.value, TimeoutError)
    assert_all_gone(caught.value.result.pids)


@pytest.mark.multi_process
def test_an_interrupted_launch_kills_every_rank(tmp_path, monkeypatch):
    started = []

    def interrupt(procs, deadline):
        started.extend(p.pid for p in procs)
        raise KeyboardInterrupt

    monkeypatch.setattr(launch_module, "_wait", interrupt)
    with pytest.raises(KeyboardInterrupt):
        launch(FIT, 2, out_dir=tmp_path, timeout=120)
    assert len(started) == 2
    assert_all_gone(started)


def test_a_rank_killed_before_it_has_its_own_process_group_is_killed_too():
    """A forked rank makes its own group (setsid) only once it runs: killed right after the fork,
    it has none yet, and a group kill alone would leave it running (and the launch waiting)."""
    import subprocess
    import sys

    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # our group, not its own
    assert os.getpgid(rank.pid) != rank.pid
    with ThreadPoolExecutor(1) as pool:
        killing = pool.submit(launch_module._kill, [rank])
        try:
            killing.result(timeout=20)
        finally:
            rank.kill()
    assert rank.returncode == -9


# -- the fork server ------------------------------------------------------------------------------

PROBE = textwrap.dedent("""
    # Run as `python -m probe --out DIR -- ACTION`: what a rank sees when it starts, then ACTION.
    import json, os, signal, sys
    preloaded = "torch" in sys.modules and "lightning" in sys.modules
    from titan_lightning.data import datamodule
    from titan_lightning.data.tokenizer import load_tokenizer
    tokenized = [key[0][0] for key in datamodule._TOKENIZED]  # corpora the fork server tokenized ahead
    load_tokenizer().encode_batch(["def f(x): return x"] * 64)  # tokenizers' thread pool works after the fork
    from lightning_utilities.core.rank_zero import rank_zero_only
    out, action = sys.argv[2], sys.argv[4]
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"preloaded": preloaded, "own_session": os.getsid(0) == os.getpid(), "argv": sys.argv[1:],
                   "marker": os.environ.get("PROBE_MARKER"), "rank_zero": getattr(rank_zero_only, "rank", None),
                   "cwd": os.getcwd(), "stdin": sys.stdin.read(), "tokenized": tokenized}, f)
    print(f"rank {rank} says hello")
    if action == "exit3" and rank == 1:
        sys.exit(3)
    if action == "term" and rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
""")


@pytest.fixture
def probe(tmp_path):
    folder = tmp_path / "probe_path"
    folder.mkdir()
    (folder / "probe.py").write_text(PROBE)
    env = {"PYTHONPATH": str(folder), "PROBE_MARKER": "here"}

    def run(action, **extra):
        return launch([action], 2, out_dir=tmp_path / action, timeout=120, env={**env, **extra}, module="probe")

    return run


@pytest.mark.multi_process
def test_ranks_are_forked_ready_with_their_own_environment_session_and_log(probe, tmp_path):
    result = probe("ok")
    for rank, seen in enumerate(result.ranks):
        assert seen["preloaded"]  # torch and Lightning were imported before the rank started
        assert seen["own_session"] and seen["marker"] == "here" and seen["stdin"] == ""
        assert seen["argv"] == ["--out", str(tmp_path / "ok"), "--", "ok"] and seen["cwd"] == os.getcwd()
        assert seen["rank_zero"] == rank  # Lightning's flag, computed at import, follows the rank's RANK
        assert f"rank {rank} says hello" in result.log(rank)
        assert seen["tokenized"] == [str(CORPUS_PATH.resolve())]  # the server tokenized it once for every rank
        assert "tokenizers" not in result.log(rank)  # no "process just got forked ... disabling parallelism"
    assert_all_gone(result.pids)


@pytest.mark.multi_process
@pytest.mark.parametrize("action, code", [("exit3", 3), ("term", -15)])
def test_forked_rank_exit_status_is_a_popens(probe, action, code):
    with pytest.raises(LaunchFailed) as failed:
        probe(action)
    assert failed.value.result.returncodes[1] == code
    assert_all_gone(failed.value.result.pids)


@pytest.mark.multi_process
@pytest.mark.slow  # two fresh interpreters importing torch: ~10 s, out of the inner loop
def test_environment_read_at_import_gets_a_fresh_interpreter(probe):
    result = probe("ok", ATEN_CPU_CAPABILITY="default")
    assert not any(seen["preloaded"] or seen["tokenized"] for seen in result.ranks)


RANKS = textwrap.dedent("""
    import torch
    import torch.distributed as dist

    def total(rank, world_size):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return t.item()
""")


@pytest.mark.multi_process
def test_a_launch_whose_port_another_process_took_starts_again_on_another(tmp_path, monkeypatch):
    """free_port's port was free a moment ago; a launch beside this one may bind it first (CI's
    test_features run on 2 workers: rank 0's store failed with EADDRINUSE). The launch starts again on
    a new port; a port taken every time still fails, after PORT_ATTEMPTS, with rank 0's error."""
    import socket

    from titan_lightning.testing.spawn import run_function

    (tmp_path / "ranks.py").write_text(RANKS)
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # (listening: another process's store)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    free_port = launch_module.free_port
    monkeypatch.setattr(launch_module, "free_port", lambda: next(ports, None) or free_port())
    env = pythonpath_env(tmp_path)
    with pytest.warns(UserWarning, match="rendezvous port was taken"):
        assert run_function("ranks:total", 2, out_dir=tmp_path / "again", timeout=120, env=env) == [3.0, 3.0]
    monkeypatch.setattr(launch_module, "free_port", lambda: taken.getsockname()[1])
    with pytest.raises(LaunchFailed, match="EADDRINUSE"), pytest.warns(UserWarning):
        run_function("ranks:total", 2, out_dir=tmp_path / "never", timeout=120, env=env)
    taken.close()
