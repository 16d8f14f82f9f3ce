"""Checkpoints through Lightning's flow, on real process groups (gloo): resume exactness, another
layout, a save killed midway. Recipes: recipes/tests/features.py (`*_save`, `*_resume`).

Each case runs a layout 10 steps straight, then 5 steps that save at step 5 and stop, then a
new set of processes that resumes from the newest checkpoint and trains steps 6-10: the
resumed steps must equal the straight run's (bitwise on the same layout).
"""

import math

import pytest

from titan_lightning.checkpoint import FAULT_ENV, PARTIAL, CheckpointError, check_checkpoint, latest_checkpoint
from titan_lightning.recipe import RUN_DIR_ENV
from titan_lightning.testing.launch import LaunchFailed, launch

pytestmark = pytest.mark.multi_process

_R = "recipes.tests.features"


def fit(recipe: str, world: int, out, run_dir=None, env=None) -> dict:
    argv = ["fit", "--recipe", f"{_R}:{recipe}", "--trainer.accelerator", "cpu", "--trainer.devices", str(world)]
    extra = dict(env or {})
    if run_dir is not None:
        extra[RUN_DIR_ENV] = str(run_dir)
    return launch(argv, world, out_dir=out, timeout=300, env=extra).ranks[0]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """10 steps straight of each layout, run once for the module."""
    cache = {}

    def get(recipe: str, world: int) -> dict:
        if recipe not in cache:
            cache[recipe] = fit(recipe, world, tmp_path_factory.mktemp(recipe))
        return cache[recipe]

    return get


def _tail(report: dict, first_step: int) -> tuple[list, list]:
    index = report["steps"].index(first_step)
    return report["losses"][index:], report["grad_norms"][index:]


@pytest.mark.parametrize("layout, world, save", [
    ("llama3_fsdp2", 2, "_save"), ("llama3_fsdp2", 2, "_save_async"), ("llama3_fsdp2_tp2", 4, "_save"),
    ("llama3_pp2", 2, "_save"),
])
def test_resume_continues_exactly(layout, world, save, straight, tmp_path):
    run_dir = tmp_path / "run"
    saved = fit(f"{layout}{save}", world, tmp_path / "save", run_dir)
    assert saved["steps"] == [1, 2, 3, 4, 5]
    resumed = fit(f"{layout}_resume", world, tmp_path / "resume", run_dir)
    assert resumed["steps"] == [6, 7, 8, 9, 10]
    reference = straight(layout, world)
    assert saved["losses"] == reference["losses"][:5]
    assert (resumed["losses"], resumed["grad_norms"]) == _tail(reference, 6)


def test_checkpoint_saved_on_fsdp4_resumes_on_fsdp2_tp2(straight, tmp_path):
    run_dir = tmp_path / "run"
    fit("llama3_fsdp4_save", 4, tmp_path / "save", run_dir)
    resumed = fit("llama3_fsdp2_tp2_resume", 4, tmp_path / "resume", run_dir)
    assert resumed["steps"] == [6, 7, 8, 9, 10]
    # Not bitwise (TP sums in another order), but the per-step numbers of the layout it resumed on.
    losses, norms = _tail(straight("llama3_fsdp2_tp2", 4), 6)
    for got, want in zip(resumed["losses"] + resumed["grad_norms"], losses + norms):
        assert math.isclose(got, want, rel_tol=1e-5), (got, want)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_to_resume_from(straight, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(LaunchFailed):  # dies in its second save (step 10), after writing part of it
        fit("llama3_pp2_every5", 2, tmp_path / "killed", run_dir, env={FAULT_ENV: "2"})
    folder = run_dir / "checkpoints"
    partial = [p for p in folder.iterdir() if p.name.endswith(PARTIAL)]
    assert [p.name for p in partial] == [f"epoch=0-step=10.ckpt{PARTIAL}"]
    assert latest_checkpoint(tmp_path).name == "epoch=0-step=5.ckpt"
    with pytest.raises(CheckpointError, match=r"step=10.ckpt.partial is incomplete \(missing .metadata\)"):
        check_checkpoint(partial[0], {})
    resumed = fit("llama3_pp2_resume", 2, tmp_path / "resume", run_dir)
    assert resumed["steps"] == [6, 7, 8, 9, 10]
    assert (resumed["losses"], resumed["grad_norms"]) == _tail(straight("llama3_pp2", 2), 6)
