"""The integration runner: flag validation, the empty-dir rule, device packing, the summary, exit codes."""

import re
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration_tests import run_tests
from tests.integration_tests.run_tests import Outcome, Task, schedule, summary
from titan_lightning.testing.entries import TestEntry
from titan_lightning.testing.launch import pythonpath_env

RECIPE = "recipes.tests.features:llama3_debugmodel"


def _main(capsys, *argv):
    try:
        status = run_tests.main([str(a) for a in argv])
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _refused(capsys, out, *argv) -> str:
    """Bad input: exit 2, one stderr line, no traceback, OUTPUT_DIR not created. Returns stderr."""
    status, _, err = _main(capsys, out, *argv)
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("python -m tests.integration_tests.run_tests: error: ")
    assert not out.exists()  # nothing ran, nothing written
    return err


@pytest.mark.parametrize("flags, message", [
    (["--test_suite", "nope"], r"--test_suite='nope': unknown suite \['nope'\]"),
    (["--test_name", "nope"], r"--test_name 'nope' is no entry of features"),
    (["--exclude", "llama3_fsdp2,nope"], r"--exclude names no entry of features: nope"),
    (["--test_name", "llama3_fsdp2", "--exclude", "llama3_fsdp2"], r"--test_name llama3_fsdp2 is also in --exclude"),
    (["--test_scope", "real_pg_required", "--execution_mode", "fake_pg"],
     r"--test_scope real_pg_required needs --execution_mode real_pg, got fake_pg"),
    (["--test_suite", "features,h100", "--execution_mode", "fake_pg"],
     r"--test_suite h100 is hardware-specific and runs real PG only"),
    (["--test_suite", "h100"], r"--test_suite h100 needs GPUs; --gpu_arch_type cpu cannot run it"),
    (["--ngpu", "0"], r"--ngpu=0 must be >= 1"),
    (["--test_scope", "real_pg_required", "--test_name", "llama3_fsdp2"], r"the flags select no test"),
    # argparse's own errors, in one line
    (["--ngpu", "abc"], r"argument --ngpu: invalid int value: 'abc'"),
    (["--execution_mode", "both"], r"argument --execution_mode: invalid choice: 'both'"),
    (["--no-such-flag"], r"unrecognized arguments: --no-such-flag"),
])
def test_bad_flags_exit_2_with_one_line_naming_them(flags, message, tmp_path, capsys):
    err = _refused(capsys, tmp_path / "out", "--gpu_arch_type", "cpu", *flags)
    assert re.search(message, err), err


def test_a_missing_output_dir_argument_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_tests.main(["--gpu_arch_type", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "the following arguments are required: output_dir" in err


def test_an_output_dir_under_a_file_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    err = _refused(capsys, tmp_path / "a_file" / "out", "--gpu_arch_type", "cpu", "--test_name", "llama3_fsdp2")
    assert f"OUTPUT_DIR {tmp_path / 'a_file' / 'out'}: cannot create the folder" in err


def test_a_gpu_arch_without_a_visible_gpu_is_refused(tmp_path):
    args = run_tests.build_parser().parse_args([str(tmp_path / "o"), "--gpu_arch_type", "cuda"])
    with pytest.raises(run_tests.RunnerError, match=r"--gpu_arch_type cuda but no GPU is visible"):
        run_tests.validate(args, gpu_count=lambda: 0)


def test_a_non_empty_output_dir_or_a_file_is_refused_and_left_as_it_was(tmp_path, capsys):
    (tmp_path / "old.log").write_text("x")
    for out, message in ((tmp_path, "is not empty"), (tmp_path / "old.log", "is a file")):
        status, _, err = _main(capsys, out, "--gpu_arch_type", "cpu")
        assert status == 2 and err.count("\n") == 1 and f"OUTPUT_DIR {out} {message}; give a new or empty folder" in err
    assert [p.name for p in tmp_path.iterdir()] == ["old.log"] and (tmp_path / "old.log").read_text() == "x"


def _suite(monkeypatch, *entries):
    monkeypatch.setattr(run_tests, "load_suite", lambda name: list(entries))


def test_a_golden_whose_header_names_another_layout_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    golden = tmp_path / "golden" / "fake_pg.txt"
    golden.parent.mkdir()
    golden.write_text("# config: x\n# ngpu: 4\n# parallelism: FSDP=4\n# step loss grad_norm\n1 8.0 1.0\n")
    entry = TestEntry(recipes=(RECIPE,), name="headed", description="d",
                      golden_numerics_path=str(tmp_path / "golden" / "{execution_mode}.txt"))
    _suite(monkeypatch, entry)
    err = _refused(capsys, tmp_path / "out", "--gpu_arch_type", "cpu", "--execution_mode", "fake_pg")
    assert "features:headed" in err and "'# ngpu: 4' but this run has ngpu '1'" in err


# Recipe modules written into tmp_path: one whose own import fails, and recipes that raise or return no Run.
RECIPE_MODULES = {
    "rt_import_fails": "import rt_no_such_dependency\n",
    "rt_recipes": "def raises():\n    raise ValueError('no data\\nat all')\n\n\ndef returns_int():\n    return 3\n",
}


@pytest.fixture
def bad_recipes(tmp_path, monkeypatch):
    for name, source in RECIPE_MODULES.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in RECIPE_MODULES:
        sys.modules.pop(name, None)


@pytest.mark.parametrize("recipe, message", [
    ("rt_no_such_module:debugmodel", r"'rt_no_such_module:debugmodel'.*no module named"),
    ("recipes.tests.features:no_such_recipe", r"has no recipe function 'no_such_recipe'"),
    ("rt_import_fails:debugmodel", r"'rt_import_fails:debugmodel'.*No module named 'rt_no_such_dependency'"),
    ("rt_recipes:raises", r"'rt_recipes:raises'.*no data at all"),  # the recipe's two-line message, on one line
    ("rt_recipes:returns_int", r"'rt_recipes:returns_int' returned int"),
])
def test_an_entry_whose_recipe_cannot_be_built_is_refused_before_anything_runs(
        recipe, message, bad_recipes, monkeypatch, capsys):
    _suite(monkeypatch, TestEntry(recipes=(recipe,), name="broken", description="d"))
    err = _refused(capsys, bad_recipes / "out", "--gpu_arch_type", "cpu", "--execution_mode", "fake_pg")
    assert re.search(r"features:broken: .*" + message, err), err


def test_a_golden_path_that_is_a_folder_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "golden" / "fake_pg.txt").mkdir(parents=True)
    entry = TestEntry(recipes=(RECIPE,), name="folder", description="d",
                      golden_numerics_path=str(tmp_path / "golden" / "{execution_mode}.txt"))
    _suite(monkeypatch, entry)
    err = _refused(capsys, tmp_path / "out", "--gpu_arch_type", "cpu", "--execution_mode", "fake_pg")
    assert "features:folder: " in err and "fake_pg.txt" in err


def test_selection_skips_what_cannot_run_and_says_why(tmp_path, monkeypatch):
    entries = [
        TestEntry(recipes=(RECIPE,), name="real_only", description="d", use_real_pg=True),
        TestEntry(recipes=(RECIPE,), name="off", description="d", disabled=True),
        TestEntry(recipes=("recipes.tests.features:llama3_hsdp2x2_tp2",), name="big", description="d", ngpu=8),
        TestEntry(recipes=(RECIPE,), name="fine", description="d"),
    ]
    _suite(monkeypatch, *entries)
    parse = run_tests.build_parser().parse_args
    fake = run_tests.validate(parse([str(tmp_path / "a"), "--gpu_arch_type", "cpu", "--execution_mode", "fake_pg"]))
    assert {t.entry.name: t.skip for t in fake} == {"real_only": "needs real PG", "off": "disabled", "big": None,
                                                    "fine": None}
    assert {t.entry.name: t.devices for t in fake}["big"] == 1  # fake PG simulates 8 ranks on one device
    real = run_tests.validate(parse([str(tmp_path / "b"), "--gpu_arch_type", "cpu", "--ngpu", "4"]))
    assert {t.entry.name: t.skip for t in real}["big"] == "needs 8 devices, --ngpu 4"
    required = run_tests.validate(parse([str(tmp_path / "c"), "--gpu_arch_type", "cpu", "--test_scope", "real_pg_required"]))
    assert [t.entry.name for t in required] == ["real_only"]


def _task(name: str, devices: int) -> Task:
    entry = TestEntry(recipes=(RECIPE,), name=name, description="d", ngpu=devices)
    return Task("features", entry, "real_pg", devices)


def _recording_executor(seconds: float = 0.05):
    lock = threading.Lock()
    events, held = [], {}

    def execute(task: Task, ids: list[int]) -> Outcome:
        with lock:
            overlap = set(ids) & {i for other in held.values() for i in other}
            held[task.entry.name] = ids
            events.append((task.entry.name, ids, sum(map(len, held.values())), overlap))
        time.sleep(seconds)
        with lock:
            del held[task.entry.name]
        return Outcome(task, "passed", devices=ids)

    return execute, events


def test_packing_starts_the_largest_first_on_disjoint_devices_within_the_pool():
    tasks = [_task("one_a", 1), _task("four", 4), _task("two", 2), _task("one_b", 1), _task("eight", 8)]
    execute, events = _recording_executor()
    outcomes = schedule(tasks, 8, execute)
    assert [o.task.entry.name for o in outcomes][:2] == ["eight", "four"]  # largest first
    assert sorted(o.task.entry.name for o in outcomes) == sorted(t.entry.name for t in tasks)
    for name, ids, in_use, overlap in events:
        assert not overlap, f"{name} got devices {ids} that another running test held"
        assert in_use <= 8
        assert len(ids) == {t.entry.name: t.devices for t in tasks}[name]
    assert max(in_use for *_, in_use, _ in events) > 4  # several ran at once


def test_no_parallel_runs_one_at_a_time_and_a_small_pool_still_runs_everything():
    tasks = [_task("a", 2), _task("b", 2), _task("c", 1)]
    execute, events = _recording_executor(0.01)
    schedule(tasks, 2, execute, parallel=False)
    assert [in_use for _, _, in_use, _ in events] == [2, 2, 1]
    with pytest.raises(ValueError, match="more than the 2 devices"):
        schedule([_task("big", 4)], 2, execute)


def test_summary_has_a_row_per_test_and_counts():
    passed = Outcome(_task("a", 2), "passed", seconds=1.25, devices=[0, 1], golden="compared x.txt")
    failed = Outcome(_task("b", 1), "failed", seconds=0.5, devices=[2])
    skipped_task = _task("c", 8)
    skipped_task.skip = "needs 8 devices, --ngpu 4"
    table = summary([passed, failed, Outcome(skipped_task, "skipped")]).splitlines()
    assert table[0].split() == ["suite", "test", "mode", "ngpu", "devices", "status", "seconds", "golden"]
    assert table[2].split() == ["features", "a", "real_pg", "2", "0,1", "passed", "1.2", "compared", "x.txt"]
    assert "skipped (needs 8 devices, --ngpu 4)" in table[4]
    assert table[-1] == "1 passed, 1 failed, 1 skipped"


@pytest.mark.slow
def test_a_real_run_passes_and_a_golden_mismatch_fails_with_exit_1_and_the_log_tail(tmp_path, monkeypatch, capsys):
    """End to end on one fake-PG entry: export, compare (passes), edit the golden, compare (fails).
    The entry trains the debug-model recipe at a smaller shape (the runner is under test)."""
    here = str(Path(__file__).parent)
    monkeypatch.syspath_prepend(here)
    monkeypatch.setenv("PYTHONPATH", pythonpath_env(here)["PYTHONPATH"])
    golden = tmp_path / "golden" / "fake_pg.txt"
    entry = TestEntry(recipes=("small_llama3:llama3_debugmodel",), name="llama3_debugmodel", description="d",
                      golden_numerics_path=str(tmp_path / "golden" / "{execution_mode}.txt"))
    _suite(monkeypatch, entry)
    common = ["--gpu_arch_type", "cpu", "--execution_mode", "fake_pg", "--ngpu", "1"]
    status, out, _ = _main(capsys, tmp_path / "export", *common, "--export-numerics")
    assert status == 0 and golden.exists() and f"exported {golden}" in out
    status, out, _ = _main(capsys, tmp_path / "compare", *common)
    assert status == 0 and "1 passed, 0 failed, 0 skipped" in out and f"compared {golden}" in out
    assert (tmp_path / "compare" / "features" / "llama3_debugmodel" / "rank0.log").exists()

    lines = golden.read_text().splitlines()
    step1 = next(i for i, line in enumerate(lines) if line.startswith("1 "))
    _, loss, norm = lines[step1].split()
    lines[step1] = f"1 {float(loss) + 1e-6!r} {norm}"
    golden.write_text("\n".join(lines) + "\n")
    status, out, _ = _main(capsys, tmp_path / "mismatch", *common)
    assert status == 1
    assert "===== FAILED features:llama3_debugmodel (fake_pg) =====" in out
    assert "step 1 loss differs: expected" in out  # from the rank log tail, both values named
    assert "0 passed, 1 failed, 0 skipped" in out
