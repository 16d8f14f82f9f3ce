"""A rank that dies mid-run: every other rank exits within 30 s and says which rank died and where
its output went. Launched as users launch: `titan-lightning fit --trainer.devices N` (Lightning's
launcher: rank 0 starts the others) and one process per rank with torchrun's environment.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_lightning.testing.launch import PORT_ATTEMPTS, free_port, rank_env
from titan_lightning.trainer import RUN_DIR_ENV

pytestmark = pytest.mark.multi_process

# The debug model's layers on a smaller shape: what a dying rank leaves behind is under test, not the model.
FIT = ["fit", "--recipe", "recipes.llama3:fsdp2", "--trainer.accelerator", "cpu", "--trainer.max_steps", "1000",
       "--trainer.enable_checkpointing", "false", "--trainer.limit_val_batches", "0", "--job.model.dim", "64",
       "--job.model.n_layers", "2", "--job.model.n_heads", "4", "--job.model.n_kv_heads", "4",
       "--job.training.seq_len", "64"]
EXIT_WITHIN_S = 30


def _wait_for(path: Path, text: bytes, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while text not in (path.read_bytes() if path.exists() else b""):
        done = proc.poll() is not None or time.monotonic() > deadline
        assert not done, f"{path} never showed {text!r}:\n{path.read_bytes()[-3000:]!r}"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float) -> float:
    start = time.monotonic()
    while any(_alive(pid) for pid in pids):
        if time.monotonic() - start > timeout:
            return float("inf")
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.fixture
def lightning_launch(tmp_path):
    """`titan-lightning fit --trainer.devices 2`: (rank 0's process, rank 1's pid, the shared output file)."""
    log = tmp_path / "out.log"
    env = {k: v for k, v in os.environ.items() if k != RUN_DIR_ENV and not k.startswith("TORCHELASTIC")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **{RUN_DIR_ENV: str(tmp_path / "run")})
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "titan_lightning.cli", *FIT, "--trainer.devices", "2"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    children: list[int] = []
    try:
        _wait_for(log, b"Epoch 0:", proc)  # training started (rank 0's progress bar)
        children = [int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        yield proc, children[0], log
    finally:
        for pid in [proc.pid, *children]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_lightning_launch_names_a_killed_rank_and_its_output(lightning_launch):
    proc, rank1, log = lightning_launch
    os.kill(rank1, signal.SIGKILL)
    assert _wait_gone([proc.pid], EXIT_WITHIN_S) <= EXIT_WITHIN_S
    assert proc.wait() == 1
    errors = [line for line in log.read_text(errors="replace").replace("\r", "\n").splitlines()
              if "titan-lightning: error:" in line]
    assert len(errors) == 1, errors
    assert f"rank 1 (pid {rank1}) was killed by SIGKILL" in errors[0] and f"its output: {log}" in errors[0]


def test_lightning_launch_a_killed_rank_0_is_named_by_the_others(lightning_launch):
    proc, rank1, log = lightning_launch
    os.kill(proc.pid, signal.SIGKILL)
    assert _wait_gone([rank1], EXIT_WITHIN_S) <= EXIT_WITHIN_S
    errors = [line for line in log.read_text(errors="replace").replace("\r", "\n").splitlines()
              if "titan-lightning: error:" in line]
    assert len(errors) == 1 and "[rank 1] rank 0 (the host of the rendezvous store" in errors[0], errors
    # Only our line: the store's death is seen without a store call that fails (torch logs those
    # with a C++ stack dump of ~25 lines, twice).
    text = log.read_text(errors="replace")
    assert "frame #" not in text and "Exception raised from" not in text and "TCPStore.cpp" not in text, text[-3000:]


def test_torchrun_style_launch_the_survivors_name_the_dead_rank_and_its_log(tmp_path):
    """Three ranks, each its own process with a log of its own (as torchrun --log-dir would); rank 1
    is killed: ranks 0 and 2 learn it from the heartbeats and name rank 1's log file."""
    world, procs = 3, []
    logs = [tmp_path / f"rank{r}.log" for r in range(world)]
    try:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = free_port()
            for rank in range(world):
                env = rank_env(rank, world, port=port, out_dir=tmp_path)
                with open(logs[rank], "wb") as out:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "titan_lightning.cli", *FIT, "--trainer.devices", str(world),
                         "--job.parallelism.dp_shard", str(world)],
                        stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True))
            try:
                _wait_for(logs[0], b"Epoch 0:", procs[0])
                break
            except AssertionError:
                # (free a moment before, the port may have been taken by a launch beside this test: start again)
                if attempt == PORT_ATTEMPTS or b"EADDRINUSE" not in logs[0].read_bytes():
                    raise
                for proc in procs:
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                procs.clear()
        time.sleep(2)  # a few heartbeats
        procs[1].kill()
        assert _wait_gone([procs[0].pid, procs[2].pid], EXIT_WITHIN_S) <= EXIT_WITHIN_S
        for rank in (0, 2):
            assert procs[rank].wait() == 1
            lines = [line for line in logs[rank].read_text(errors="replace").replace("\r", "\n").splitlines()
                     if "titan-lightning: error:" in line]
            assert len(lines) == 1, lines
            assert f"[rank {rank}] rank 1 (pid {procs[1].pid} on " in lines[0]
            assert f"its output: {logs[1]}" in lines[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
