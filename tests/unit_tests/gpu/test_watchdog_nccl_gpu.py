"""The hang watchdog over NCCL's flight recorder, two GPUs: a rank that never enters the collective
its peer waits in is named, and so are ranks waiting in two different collectives under one number
(test_watchdog.py is the same on gloo)."""

import os
import re
from pathlib import Path

import pytest

from titan_lightning.testing import LaunchFailed
from titan_lightning.testing.launch import pythonpath_env
from titan_lightning.testing.spawn import run_function

CPU_CASES = Path(__file__).parents[1] / "cpu"
ENV = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0,1"),
       **pythonpath_env(CPU_CASES)}

pytestmark = pytest.mark.multi_gpu


def _verdict(tmp_path, case: str) -> tuple[str, list[int]]:
    with pytest.raises(LaunchFailed) as failed:
        run_function("watchdog_cases:nccl_ranks", 2, out_dir=tmp_path, timeout=180, env=ENV, init_process_group=False,
                     dump_dir=str(tmp_path / "traces"), timeout_s=5.0, case=case)
    result = failed.value.result
    lines = [line for rank in (0, 1) for line in result.log(rank).splitlines() if "titan-lightning: error:" in line]
    assert lines, result.log_tails()
    return lines[0], result.pids


def test_a_rank_that_never_enters_an_nccl_collective_is_named(tmp_path):
    line, pids = _verdict(tmp_path, "sleepy")
    assert f"hung collective: rank 1 (pid {pids[1]} on " in line and " never entered nccl:all_reduce #2 " in line, line
    assert "rank 1 is at step 0 in nccl_ranks (" in line, line


def test_ranks_in_two_different_nccl_collectives_are_named_with_both(tmp_path):
    line, pids = _verdict(tmp_path, "mismatch")
    assert re.search(rf"rank 1 \(pid {pids[1]} on .*\) entered nccl:all_reduce #2 of process group .* where rank 0 "
                     rf"entered nccl:\w+ #2 \(mismatched collectives", line), line
