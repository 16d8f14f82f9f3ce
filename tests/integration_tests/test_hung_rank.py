"""A rank hung inside a step (alive, beating): the run ends within comm.train_timeout_s and a few
seconds, with one line on the terminal naming the rank, its pid, the collective its peer waits in
and where the hung rank is. Launched as users launch: `titan-lightning fit --trainer.devices 2`
(Lightning's launcher, one terminal for both ranks)."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration_tests.test_faults import _wait_gone
from titan_lightning.testing.launch import pythonpath_env
from titan_lightning.trainer import RUN_DIR_ENV

pytestmark = pytest.mark.multi_process

HERE = Path(__file__).parent
TIMEOUT_S = 15  # the recipe's comm.train_timeout_s
LIMIT_S = 120  # the whole launch, startup included: the test's own hard timeout


def test_a_rank_hung_in_its_step_is_named_within_the_timeout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != RUN_DIR_ENV and not k.startswith("TORCHELASTIC")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **{RUN_DIR_ENV: str(tmp_path / "run")},
               **pythonpath_env(HERE))
    argv = [sys.executable, "-m", "titan_lightning.cli", "fit", "--recipe", "hang_recipes:fsdp2_rank1_hangs",
            "--trainer.accelerator", "cpu", "--trainer.devices", "2"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=LIMIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    raw = output.decode(errors="replace")
    text = raw.replace("\r", "\n")
    assert proc.returncode == 1, text[-3000:]
    assert "\ntitan-lightning: error:" in raw, raw[-3000:]  # (a line of its own, not the progress bar's end)
    errors = [line for line in text.splitlines() if "titan-lightning: error:" in line]
    assert len(errors) == 1, errors
    line = errors[0]
    assert "hung collective: rank 1 (pid " in line and " never entered gloo:" in line, line
    assert f"(comm.train_timeout_s={TIMEOUT_S})" in line and "rank 1 is at step 2 in " in line, line
    assert "on_before_backward (" in line and "hang_recipes.py:" in line, line
    assert "Traceback" not in text, text[-3000:]
    traces = tmp_path / "run" / "comm_traces"
    assert f"of every rank: {traces}" in line
    assert "on_before_backward" in (traces / "rank1_stacks.txt").read_text()
    assert (traces / "rank0_flight_recorder.json").exists()
    rank1 = int(re.search(r"rank 1 \(pid (\d+) ", line).group(1))
    assert _wait_gone([rank1], 15) <= 15  # rank 1, started by rank 0, left too
