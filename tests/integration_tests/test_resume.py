"""Checkpoints through Lightning's flow, on real process groups (gloo): resume exactness (sync and
async saves), another layout, a save killed at several moments, a full disk.
Recipes: recipes/tests/features.py (`*_every2*`, `*_save`, `*_resume`).

Each layout runs 5 steps straight once; a saving run writes checkpoints at steps 2 and 4
while training goes on (an async save overlaps steps 3-5); a new set of processes resumes
from the step-2 checkpoint and trains steps 3-5, which must equal the straight run's bitwise.
"""

import math
import shutil
import subprocess
import uuid

import pytest

from titan_lightning.checkpoint import PARTIAL, CheckpointError, check_checkpoint, check_files, latest_checkpoint, verify
from titan_lightning.testing.faults import FAULT_ENV
from titan_lightning.testing.launch import LaunchFailed, launch
from titan_lightning.trainer import RUN_DIR_ENV

# Each test is a save-then-resume pair of multi-rank runs: tens of seconds on 2 cores.
pytestmark = [pytest.mark.multi_process, pytest.mark.slow]

_R = "recipes.tests.features"


def fit(recipe: str, world: int, out, run_dir=None, env=None, extra=()) -> dict:
    argv = ["fit", "--recipe", f"{_R}:{recipe}", "--trainer.accelerator", "cpu", "--trainer.devices", str(world),
            *extra]
    variables = dict(env or {})
    if run_dir is not None:
        variables[RUN_DIR_ENV] = str(run_dir)
    return launch(argv, world, out_dir=out, timeout=300, env=variables).ranks[0]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """5 steps straight of each layout, run once for the module."""
    cache = {}

    def get(recipe: str, world: int) -> dict:
        if recipe not in cache:
            cache[recipe] = fit(recipe, world, tmp_path_factory.mktemp(recipe))
        return cache[recipe]

    return get


def _tail(report: dict, first_step: int) -> tuple[list, list]:
    index = report["steps"].index(first_step)
    return report["losses"][index:], report["grad_norms"][index:]


def _step2(run_dir):
    return run_dir / "checkpoints" / "epoch=0-step=2.ckpt"


@pytest.mark.parametrize("layout, world, saving", [
    ("llama3_fsdp2", 2, "_every2"), ("llama3_fsdp2", 2, "_every2_async"), ("llama3_fsdp2_tp2", 4, "_every2_async"),
    ("llama3_pp2", 2, "_every2_async"),
])
def test_resume_continues_exactly(layout, world, saving, straight, tmp_path):
    """Sync and async saves at 2 and 4 ranks: saving leaves training untouched (async writes while
    steps 3-5 train), and the run resumed from step 2 repeats steps 3-5 bitwise."""
    run_dir = tmp_path / "run"
    saved = fit(f"{layout}{saving}", world, tmp_path / "save", run_dir)
    reference = straight(layout, world)
    assert (saved["steps"], saved["losses"], saved["grad_norms"]) == (
        reference["steps"], reference["losses"], reference["grad_norms"])
    manifest = verify(_step2(run_dir))
    assert manifest["world_size"] == world and latest_checkpoint(run_dir).name == "epoch=0-step=4.ckpt"
    # Every rank's shard is in the manifest (sent to rank 0 with DCP's write results), checksums right, and
    # every rank's state (RNG, data position) in it too: the folder holds Lightning's files only.
    assert {f"__{r}_0.distcp" for r in range(world)} | {".metadata"} == set(manifest["files"])
    assert len(manifest["ranks"]) == world and {p.name for p in _step2(run_dir).iterdir()} == {
        "meta.pt", *manifest["files"]}
    check_files(_step2(run_dir), manifest)
    resumed = fit(layout, world, tmp_path / "resume", tmp_path / "resumed",
                  extra=["--job.checkpoint.resume_from", str(_step2(run_dir))])
    assert resumed["steps"] == [3, 4, 5]
    assert (resumed["losses"], resumed["grad_norms"]) == _tail(reference, 3)


def test_checkpoint_saved_on_fsdp4_resumes_on_fsdp2_tp2(straight, tmp_path):
    run_dir = tmp_path / "run"
    fit("llama3_fsdp4_save", 4, tmp_path / "save", run_dir)
    resumed = fit("llama3_fsdp2_tp2_resume", 4, tmp_path / "resume", run_dir)
    assert resumed["steps"] == [3, 4, 5]
    # Not bitwise (TP sums in another order), but the per-step numbers of the layout it resumed on.
    losses, norms = _tail(straight("llama3_fsdp2_tp2", 4), 3)
    for got, want in zip(resumed["losses"] + resumed["grad_norms"], losses + norms):
        assert math.isclose(got, want, rel_tol=1e-5), (got, want)


@pytest.mark.parametrize("fault, recipe", [
    ("1:files", "llama3_pp2_every2"),          # the first save: nothing to resume from, the rerun starts fresh
    ("2:begin", "llama3_pp2_every2"),          # the .partial folder just made
    ("2:files", "llama3_pp2_every2"),          # meta.pt and rank files written, no shards
    ("2:written", "llama3_pp2_every2_async"),  # shards written in the background, no manifest yet
])
def test_a_run_killed_during_a_save_resumes_from_latest_exactly(fault, recipe, straight, tmp_path):
    """Killed at a moment of a save, `resume_from latest` continues as the uninterrupted run would."""
    run_dir = tmp_path / "run"
    with pytest.raises(LaunchFailed):
        fit(recipe, 2, tmp_path / "killed", run_dir, env={FAULT_ENV: fault})
    folder = run_dir / "checkpoints"
    killed_step = 2 if fault.startswith("1:") else 4
    partial = [p.name for p in folder.iterdir() if p.name.endswith(PARTIAL)]
    assert partial == [f"epoch=0-step={killed_step}.ckpt{PARTIAL}"]
    with pytest.raises(CheckpointError, match=r"is incomplete|does not point to a valid checkpoint"):
        check_checkpoint(folder / partial[0], {}) if fault.endswith(("begin", "files")) else verify(folder / partial[0])
    resumed = fit("llama3_pp2_resume", 2, tmp_path / "resume", run_dir)
    reference = straight("llama3_pp2", 2)
    first = 1 if killed_step == 2 else 3
    assert resumed["steps"] == list(range(first, 6))
    assert (resumed["losses"], resumed["grad_norms"]) == _tail(reference, first)


@pytest.fixture
def small_disk(tmp_path):
    """A 110 MiB tmpfs (one debugmodel checkpoint is ~73 MiB: the second save fills it), or None
    where this machine cannot mount one (then the full disk is injected into DCP's writes)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=110m", f"titan{uuid.uuid4().hex[:6]}", str(mount)],
                          capture_output=True)
    if done.returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_fails_the_save_in_one_line_and_keeps_the_previous_checkpoint(small_disk, tmp_path):
    run_dir = (small_disk or tmp_path) / "run"
    env = {} if small_disk is not None else {FAULT_ENV: "2:enospc"}
    with pytest.raises(LaunchFailed) as failed:
        fit("llama3_fsdp2_every2", 2, tmp_path / "full", run_dir, env=env)
    log = failed.value.result.log(0)
    target = run_dir / "checkpoints" / "epoch=0-step=4.ckpt"
    assert f"CheckpointError: saving checkpoint {target} failed: [Errno 28] No space left on device" in log
    folders = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert folders == ["epoch=0-step=2.ckpt"]  # the .partial was removed, the previous one is whole
    assert verify(_step2(run_dir))["global_step"] == 2 and latest_checkpoint(run_dir) == _step2(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)


def test_sigterm_saves_after_the_step_and_the_same_command_continues_exactly(straight, tmp_path):
    """Rank 1 alone gets SIGTERM after step 3: both ranks save step 3 and exit cleanly; rerun with
    `resume_from latest`, steps 4-5 equal the uninterrupted run's."""
    run_dir = tmp_path / "run"
    result = launch(["fit", "--recipe", f"{_R}:llama3_fsdp2_sigterm", "--trainer.accelerator", "cpu",
                     "--trainer.devices", "2"], 2, out_dir=tmp_path / "stopped", timeout=300,
                    env={RUN_DIR_ENV: str(run_dir)})
    assert result.returncodes == [0, 0]
    assert [rank["steps"] for rank in result.ranks] == [[1, 2, 3]] * 2
    assert "SIGTERM: stopped after step 3" in result.log(0)
    assert verify(run_dir / "checkpoints" / "epoch=0-step=3.ckpt")["global_step"] == 3
    resumed = fit("llama3_fsdp2_resume", 2, tmp_path / "resume", run_dir)
    assert resumed["steps"] == [4, 5]
    assert (resumed["losses"], resumed["grad_norms"]) == _tail(straight("llama3_fsdp2", 2), 4)


def test_sft_resumes_exactly_mid_epoch_and_on_another_data_parallel_size(straight, tmp_path):
    """Loss-masked packed conversations (data.sft): resumed from step 2 on the same layout, steps 3-5
    repeat bitwise (the same windows, the same supervised-token normalization); on one process the
    data continues from the same conversations and the numbers are the one-process run's."""
    run_dir = tmp_path / "run"
    saved = fit("llama3_sft_fsdp2_every2", 2, tmp_path / "save", run_dir)
    reference = straight("llama3_sft_fsdp2", 2)
    assert (saved["losses"], saved["grad_norms"]) == (reference["losses"], reference["grad_norms"])
    resume = ["--job.checkpoint.resume_from", str(_step2(run_dir))]
    resumed = fit("llama3_sft_fsdp2", 2, tmp_path / "resume", tmp_path / "resumed", extra=resume)
    assert resumed["steps"] == [3, 4, 5]
    assert (resumed["losses"], resumed["grad_norms"]) == _tail(reference, 3)
    one = fit("llama3_sft", 1, tmp_path / "one", tmp_path / "one_run", extra=resume)
    assert one["steps"] == [3, 4, 5]
    for got, want in zip(one["losses"] + one["grad_norms"], sum(_tail(reference, 3), [])):
        assert math.isclose(got, want, rel_tol=1e-5), (got, want)
