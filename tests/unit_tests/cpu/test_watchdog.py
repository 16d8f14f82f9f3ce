"""A rank stuck in its step (alive, beating) while its peers wait in a collective: after the
timeout one line names it, the collective and where it is; every rank's stacks and flight
recorder are written; no watchdog or heartbeat thread outlives ``trainer.fit``."""

import os
from pathlib import Path

import pytest

from titan_lightning.testing import LaunchFailed
from titan_lightning.testing.spawn import run_function

CASES_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}


@pytest.mark.multi_process
def test_a_rank_stuck_in_its_step_is_named_with_the_collective_its_peer_waits_in(tmp_path):
    dumps = tmp_path / "traces"
    with pytest.raises(LaunchFailed) as failed:
        run_function("watchdog_cases:sleepy_rank", 2, out_dir=tmp_path, timeout=50, env=CASES_ENV,
                     dump_dir=str(dumps), timeout_s=2.0, sleep_s=40.0)
    result = failed.value.result
    assert result.returncodes[1] == 1  # (rank 0 leaves last: the launch kills it once rank 1 has failed)
    lines = [line for line in result.log(0).splitlines() if "titan-lightning: error:" in line]
    assert len(lines) == 1, result.log_tails()
    line = lines[0]
    assert line.startswith("titan-lightning: error: [rank 0] hung collective: ")
    assert f"rank 1 (pid {result.pids[1]} on " in line
    assert "never entered gloo:all_reduce #2 of process group 0 (default_pg), in which rank 0 has waited " in line
    assert "(comm.init_timeout_s=2)" in line
    assert "rank 1 is at step 0 in sleepy_rank (" in line and "watchdog_cases.py:" in line
    assert str(dumps) in line
    assert "sleepy_rank" in (dumps / "rank1_stacks.txt").read_text()
    for rank in (0, 1):
        assert '"gloo:all_reduce"' in (dumps / f"rank{rank}_flight_recorder.json").read_text()


@pytest.mark.multi_process
def test_a_rank_slower_than_its_peer_but_within_the_timeout_is_left_alone(tmp_path):
    results = run_function("watchdog_cases:sleepy_rank", 2, out_dir=tmp_path, timeout=50, env=CASES_ENV,
                           dump_dir=str(tmp_path / "traces"), timeout_s=3.0, sleep_s=1.5)
    assert results == ["finished"] * 2
    assert not (tmp_path / "traces").exists()


@pytest.mark.multi_process
def test_no_thread_of_ours_outlives_fit(tmp_path):
    for threads in run_function("watchdog_cases:threads_after_fit", 2, out_dir=tmp_path, timeout=110, env=CASES_ENV,
                                root=str(tmp_path)):
        assert {"titan-lightning-heartbeat", "titan-lightning-watchdog"} <= set(threads["in_step"]), threads
        assert not [name for name in threads["after_fit"] if name.startswith("titan-lightning")], threads


@pytest.mark.parametrize("override, message", [
    (["--job.comm.train_timeout_s", "0"], "comm.train_timeout_s=0.0 must be a number of seconds > 0"),
    (["--job.comm.init_timeout_s", "-5"], "comm.init_timeout_s=-5.0 must be a number of seconds > 0"),
    (["--job.comm.trace_buf_size", "-1"], "comm.trace_buf_size=-1 must be an integer >= 0"),
])
def test_bad_comm_settings_fail_before_launch_in_one_line(override, message, tmp_path, monkeypatch, capsys):
    from titan_lightning import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["fit", "--recipe", "recipes.llama3:fsdp2", *override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "runs").exists()
