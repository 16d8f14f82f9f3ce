"""A rank stuck in its step (alive, beating) while its peers wait in a collective: after the
timeout one line names it, the collective and where it is (or, when the ranks wait in different
collectives, both); every rank's stacks and flight recorder are written; a rank that was only late
(it entered the collective while its account was asked) is left alone; a plain LightningModule's
timeout is the strategy's; no watchdog or heartbeat thread, nor the flight recorder's variable,
outlives ``trainer.fit``, also one that failed."""

import re
from pathlib import Path

import pytest

from titan_lightning.testing import LaunchFailed
from titan_lightning.testing.launch import pythonpath_env
from titan_lightning.testing.spawn import run_function

CASES_ENV = pythonpath_env(Path(__file__).parent)


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
def test_a_rank_that_enters_the_collective_while_its_peer_reports_it_late_is_left_alone(tmp_path):
    # Rank 1 comes 2.5 s late to a collective with a 2 s timeout and answers rank 0's request 1.5 s
    # after seeing it (a loaded machine): when the accounts are in, every rank entered the collective,
    # the last ~1 s before, and it completed. A slow rank, not a hung backend: the incident is withdrawn.
    results = run_function("watchdog_cases:late_rank", 2, out_dir=tmp_path, timeout=50, env=CASES_ENV,
                           dump_dir=str(tmp_path / "traces"), timeout_s=2.0, late_s=2.5, answer_after_s=1.5)
    assert results == ["finished"] * 2
    assert (tmp_path / "traces" / "rank1_stacks.txt").exists()  # (the incident was raised, and answered)


@pytest.mark.multi_process
def test_a_rank_stuck_before_using_an_async_collective_is_named_whichever_rank_reports(tmp_path):
    # Rank 1's own open collective (an async all-reduce it has not used) may be the first one past a
    # timeout: it completed on rank 0, which waits in the next one; the line names rank 1 and that one.
    with pytest.raises(LaunchFailed) as failed:
        run_function("watchdog_cases:stuck_after_async", 2, out_dir=tmp_path, timeout=50, env=CASES_ENV,
                     dump_dir=str(tmp_path / "traces"), timeout_s=2.0, sleep_s=30.0)
    result = failed.value.result
    lines = [line for rank in (0, 1) for line in result.log(rank).splitlines() if "titan-lightning: error:" in line]
    assert lines, result.log_tails()
    assert f"hung collective: rank 1 (pid {result.pids[1]} on " in lines[0], lines
    assert "never entered gloo:all_reduce #3 of process group 0 (default_pg), in which rank 0 has waited" in lines[0]
    assert "rank 1 is at step 0 in stuck_after_async (" in lines[0], lines


def test_a_collective_done_on_another_rank_turns_the_verdict_to_the_one_its_peer_waits_in():
    # The accounts of CI's failed run (stop 61): rank 1, stuck before its backward, had not waited on
    # all-reduce #45 (done on rank 0, which waits in all-gather #46) and reported it first.
    from titan_lightning.parallel.watchdog import Watchdog

    request = {"rank": 1, "group": "0", "desc": "default_pg", "seq": 45, "op": "gloo:all_reduce", "waited_s": 15.2,
               "timeout_s": 15.0, "field": "comm.train_timeout_s", "ranks": [0, 1]}
    called = {"op": "gloo:all_reduce", "sizes": "[[]]"}
    answers = {0: {"rank": 0, "entered": 46, "completed": 45, "called": called, "entered_s": 15.2,
                   "opened": {"seq": 46, "op": "gloo:all_gather", "waited_s": 15.1}},
               1: {"rank": 1, "entered": 45, "completed": 44, "called": called, "entered_s": 15.2,
                   "opened": {"seq": 45, "op": "gloo:all_reduce", "waited_s": 15.2}}}
    target = Watchdog._retarget(request, answers)
    assert (target["rank"], target["seq"], target["op"], target["waited_s"]) == (0, 46, "gloo:all_gather", 15.1)
    assert Watchdog._late(target, answers) is None  # (rank 0 waited past the timeout: a hang, rank 1 behind)
    assert [r for r in (0, 1) if answers[r]["entered"] < target["seq"]] == [1]
    early = {0: dict(answers[0], opened={"seq": 46, "op": "gloo:all_gather", "waited_s": 9.0}), 1: answers[1]}
    assert Watchdog._late(Watchdog._retarget(request, early), early) == 9.0  # (not yet: counted again from there)
    assert Watchdog._retarget(request, {0: dict(answers[0], completed=44), 1: answers[1]}) is request  # open on both


def test_the_requester_s_own_unwaited_collective_done_on_its_peer_turns_the_verdict_to_the_one_it_waits_in():
    # The accounts of a CI-like run's failure (this stop): a plain module's rank 0 works alone after its
    # step; rank 1 had not waited on all-reduce #26 (done on rank 0: completed 26) and waits in broadcast
    # #27, which rank 0 never entered. Rank 1 reported #26 (its oldest open one): "every rank entered
    # gloo:all_reduce #26 ... the backend hangs". The verdict is #27's: rank 0 never entered it.
    from titan_lightning.parallel.watchdog import Watchdog

    request = {"rank": 1, "group": "0", "desc": "default_pg", "seq": 26, "op": "gloo:all_reduce", "waited_s": 2.1,
               "timeout_s": 2.0, "field": "comm.train_timeout_s", "ranks": [0, 1]}
    called = {"op": "gloo:all_reduce", "sizes": "[[]]"}
    answers = {0: {"rank": 0, "entered": 26, "completed": 26, "called": called, "entered_s": 2.3, "opened": None},
               1: {"rank": 1, "entered": 27, "completed": 25, "called": called, "entered_s": 2.1,
                   "opened": {"seq": 27, "op": "gloo:broadcast", "waited_s": 2.05}}}
    target = Watchdog._retarget(request, answers)
    assert (target["rank"], target["seq"], target["op"]) == (1, 27, "gloo:broadcast")
    assert Watchdog._late(target, answers) is None
    assert [r for r in (0, 1) if answers[r]["entered"] < target["seq"]] == [0]  # (named: never entered #27)


@pytest.mark.multi_process
def test_ranks_in_different_collectives_under_one_number_are_named_with_both_collectives(tmp_path):
    dumps = tmp_path / "traces"
    with pytest.raises(LaunchFailed) as failed:
        run_function("watchdog_cases:mismatched_collective", 2, out_dir=tmp_path, timeout=50, env=CASES_ENV,
                     dump_dir=str(dumps), timeout_s=2.0)
    result = failed.value.result
    lines = [line for rank in (0, 1) for line in result.log(rank).splitlines() if "titan-lightning: error:" in line]
    assert lines, result.log_tails()
    line = lines[0]
    assert line.startswith("titan-lightning: error: [rank "), line  # (not after the progress bar's unended line)
    assert f"hung collective: rank 1 (pid {result.pids[1]} on " in line, line
    assert re.search(r"\) entered gloo:all_reduce #2 of process group 0 \(default_pg\) where rank 0 entered "
                     r"gloo:all_gather #2 \(mismatched collectives; waited \d+ s, comm.init_timeout_s=2\); "
                     r"rank 1 is at step 0 in all_reduce \(", line), line
    assert "the network" not in line, line
    at = r"is at step 0 in [^;]*<- mismatched_collective \([^)]*watchdog_cases.py:(\d+)\)"
    calls = {rank: int(re.search(rf"rank {rank} {at}", line).group(1)) for rank in (0, 1)}
    assert calls[1] == calls[0] - 1, line  # (rank 1's extra all_reduce, the line before the all_gather)


@pytest.mark.multi_process
def test_a_plain_module_s_rank_working_alone_longer_than_the_strategy_timeout_is_named(tmp_path):
    with pytest.raises(LaunchFailed) as failed:
        run_function("watchdog_cases:solo_rank", 2, out_dir=tmp_path, timeout=110, env=CASES_ENV,
                     init_process_group=False, root=str(tmp_path), timeout_s=2.0, solo_s=60.0)
    result = failed.value.result
    lines = [line for rank in (0, 1) for line in result.log(rank).splitlines() if "titan-lightning: error:" in line]
    assert lines, result.log_tails()
    assert f"hung collective: rank 0 (pid {result.pids[0]} on " in lines[0], lines
    assert re.search(r"has waited \d+ s \(TitanStrategy.timeout=2\); rank 0 is at step 1 in on_train_batch_end \(",
                     lines[0]), lines


@pytest.mark.multi_process
def test_the_strategy_timeout_governs_a_plain_module_and_no_thread_or_variable_outlives_fit(tmp_path):
    # Rank 0 works alone 3 s after step 1 (in a real run: a 130 s evaluation); the strategy's
    # timeout, not comm.train_timeout_s (a plain module has no job), is the watchdog's.
    for rank in run_function("watchdog_cases:solo_rank", 2, out_dir=tmp_path, timeout=110, env=CASES_ENV,
                             init_process_group=False, root=str(tmp_path), timeout_s=20.0, solo_s=3.0):
        fit, failed = rank["after_fit"], rank["after_failed_fit"]
        assert fit["watchdog"] == [20.0, 20.0, ["TitanStrategy.timeout"] * 2], fit
        assert fit["process_group_s"] == 80.0, fit  # (the backstop: 60 s after the watchdog)
        assert {"titan-lightning-heartbeat", "titan-lightning-watchdog"} <= set(fit["in_step"]), fit
        for after in (fit, failed):
            assert not [name for name in after["threads"] if name.startswith("titan-lightning")], after
            assert after["environment"] is False, after


@pytest.mark.parametrize("override, message", [
    (["--job.comm.train_timeout_s", "0"], "comm.train_timeout_s=0.0 must be a number of seconds > 0"),
    (["--job.comm.init_timeout_s", "-5"], "comm.init_timeout_s=-5.0 must be a number of seconds > 0"),
    (["--job.comm.trace_buf_size", "-1"], "comm.trace_buf_size=-1 must be an integer >= 0"),
    (["--job.comm.heartbeat_timeout_s", "-1"], "comm.heartbeat_timeout_s=-1.0 must be a number of seconds > 0"),
])
def test_bad_comm_settings_fail_before_launch_in_one_line(override, message, tmp_path, monkeypatch, capsys):
    from titan_lightning import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["fit", "--recipe", "recipes.llama3:fsdp2", *override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "runs").exists()
