"""The heartbeat names a dead rank even on a survivor whose collective never fails, and takes a
rank that ended normally for nothing worse."""

import os
from pathlib import Path

import pytest

from titan_lightning.testing import LaunchFailed
from titan_lightning.testing.spawn import run_function

CASES_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}

pytestmark = pytest.mark.multi_process


def test_a_survivor_blocked_on_a_live_peer_names_the_dead_rank_and_exits(tmp_path):
    with pytest.raises(LaunchFailed) as failed:
        run_function("heartbeat_cases:blocked_survivor", 3, out_dir=tmp_path, timeout=60, env=CASES_ENV)
    result = failed.value.result
    assert result.returncodes[2] == 1
    lines = [line for line in result.log(2).splitlines() if "titan-lightning: error:" in line]
    assert len(lines) == 1, lines
    assert f"[rank 2] rank 1 (pid {result.pids[1]} on " in lines[0] and "stopped: no heartbeat" in lines[0]


def test_a_rank_that_stopped_its_heartbeat_normally_is_not_taken_for_dead(tmp_path):
    results = run_function("heartbeat_cases:early_finisher", 3, out_dir=tmp_path, timeout=60, env=CASES_ENV)
    assert results == ["finished"] * 3
