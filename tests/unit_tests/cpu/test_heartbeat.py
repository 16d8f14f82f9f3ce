"""The heartbeat names a dead rank even on a survivor whose collective never fails, within seconds
on the same host; takes a rank that ended normally, or that is alive but stopped, for nothing
worse (nor does the stopped rank's watchdog count the time it was stopped); and calls a silent
rank on another host dead after its timeout."""

import re
from pathlib import Path

import pytest

from titan_lightning.testing import LaunchFailed
from titan_lightning.testing.launch import pythonpath_env
from titan_lightning.testing.spawn import run_function

CASES_ENV = pythonpath_env(Path(__file__).parent)

pytestmark = pytest.mark.multi_process


def test_a_survivor_blocked_on_a_live_peer_names_the_dead_rank_and_exits(tmp_path):
    with pytest.raises(LaunchFailed) as failed:
        run_function("heartbeat_cases:blocked_survivor", 3, out_dir=tmp_path, timeout=60, env=CASES_ENV)
    result = failed.value.result
    assert result.returncodes[2] == 1
    lines = [line for line in result.log(2).splitlines() if "titan-lightning: error:" in line]
    assert len(lines) == 1, lines
    assert f"[rank 2] rank 1 (pid {result.pids[1]} on " in lines[0]
    # (its exit status while the launcher has not reaped it yet; once reaped, only that it is gone)
    assert ") exited with status 0 without ending its run" in lines[0] or ") is gone: its process ended" in lines[0]


def test_a_killed_rank_is_named_within_5_seconds(tmp_path):
    # (not for its silence: a peer elsewhere would have 60 s)
    ranks = run_function("heartbeat_cases:killed_peer", 2, out_dir=tmp_path, timeout=60, env=CASES_ENV, timeout_s=60.0,
                         elsewhere=False)
    told = ranks[1]
    assert told["account"].startswith(f"rank 2 (pid {ranks[0]['pid']} on "), told
    assert ") was killed by SIGKILL (the out-of-memory killer, a scheduler or a user)" in told["account"], told
    assert told["seconds"] < 5, told


def test_a_killed_rank_on_another_host_is_named_after_the_heartbeat_timeout(tmp_path):
    ranks = run_function("heartbeat_cases:killed_peer", 2, out_dir=tmp_path, timeout=60, env=CASES_ENV, timeout_s=2.0,
                         elsewhere=True)
    told = ranks[1]
    assert (told["account"] or "").startswith(f"rank 2 (pid {ranks[0]['pid']} on "), told
    assert re.search(r"\) stopped: no heartbeat for \d+ s \(comm.heartbeat_timeout_s=2; ", told["account"]), told
    assert 2 - 1 <= told["seconds"] < 6, told  # (silent 2 s since its last beat, up to a beat before the kill)


def test_a_rank_that_stopped_its_heartbeat_normally_is_not_taken_for_dead(tmp_path):
    results = run_function("heartbeat_cases:early_finisher", 3, out_dir=tmp_path, timeout=60, env=CASES_ENV)
    assert results == ["finished"] * 3


def test_a_rank_stopped_and_continued_on_the_same_host_finishes_the_run(tmp_path):
    # 3 s stopped: five times the heartbeat's timeout (0.6 s) plus its grace (1 s) in these cases,
    # and longer than the watchdog's (2 s) over the collective the stopped rank waits in.
    results = run_function("heartbeat_cases:stopped_rank", 2, out_dir=tmp_path, timeout=60, env=CASES_ENV,
                           stop_s=3.0, elsewhere=False, dump_dir=str(tmp_path / "traces"))
    assert results == ["finished"] * 2
    assert not (tmp_path / "traces").exists()


def test_a_rank_on_another_host_silent_for_longer_than_the_timeout_is_called_dead(tmp_path):
    with pytest.raises(LaunchFailed) as failed:
        run_function("heartbeat_cases:stopped_rank", 2, out_dir=tmp_path, timeout=60, env=CASES_ENV,
                     stop_s=3.0, elsewhere=True, dump_dir=str(tmp_path / "traces"))
    result = failed.value.result
    assert result.returncodes[0] == 1
    lines = [line for line in result.log(0).splitlines() if "titan-lightning: error:" in line]
    assert len(lines) == 1, result.log_tails()
    assert f"[rank 0] rank 1 (pid {result.pids[1]} on " in lines[0], lines
    assert re.search(r"\) stopped: no heartbeat for \d+ s \(comm.heartbeat_timeout_s=0.6; ", lines[0]), lines
