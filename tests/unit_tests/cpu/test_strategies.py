"""TitanStrategy and friends: real multi-process parity with one process, FakePG, user modules.

Multi-process tests start one real process per rank (gloo on CPU) through
titan_lightning.testing.launch, each with a hard timeout; none outlives its test.
"""

import math
import os
from pathlib import Path

import pytest

from titan_lightning.testing.launch import launch, run_single

STEPS = 5
FIT = ["fit", "--trainer.accelerator", "cpu", "--trainer.max_steps", str(STEPS)]

# (recipe in recipes.tests.features, world size)
LAYOUTS = [
    ("llama3_fsdp2", 2),
    ("llama3_ddp2", 2),
    ("llama3_tp2", 2),
    ("llama3_tp2_no_sp", 2),
    ("llama3_fsdp4", 4),
    ("llama3_ddp4", 4),
    ("llama3_hsdp2x2", 4),
    ("llama3_tp4", 4),
    ("llama3_tp4_no_sp", 4),
    ("llama3_fsdp2_tp2", 4),
    ("llama3_hsdp2x2_tp2", 8),
]


def _argv(recipe: str, world_size: int) -> list[str]:
    return [*FIT, "--recipe", f"recipes.tests.features:{recipe}", "--trainer.devices", str(world_size)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run every layout must match (same seed, same global batch)."""
    result = run_single(_argv("llama3_debugmodel", 1), out_dir=tmp_path_factory.mktemp("reference"), timeout=300)
    return result.ranks[0]


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.multi_process
@pytest.mark.parametrize("recipe, world_size", LAYOUTS, ids=[f"{r}-w{w}" for r, w in LAYOUTS])
def test_layout_matches_single_process(recipe, world_size, reference, tmp_path):
    result = launch(_argv(recipe, world_size), world_size, out_dir=tmp_path, timeout=420)
    for rank in result.ranks:
        assert rank["world_size"] == world_size
        assert len(rank["losses"]) == STEPS
        # Every rank logs the same global loss and grad norm.
        assert rank["losses"] == result.ranks[0]["losses"]
        assert rank["grad_norms"] == result.ranks[0]["grad_norms"]
    got = result.ranks[0]
    for step, (loss, ref) in enumerate(zip(got["losses"], reference["losses"]), start=1):
        assert _relative(loss, ref) < 1e-5, f"step {step}: loss {loss!r} vs single process {ref!r}"
    for step, (norm, ref) in enumerate(zip(got["grad_norms"], reference["grad_norms"]), start=1):
        assert _relative(norm, ref) < 1e-4, f"step {step}: grad norm {norm!r} vs single process {ref!r}"


@pytest.mark.multi_process
def test_bf16_mixed_precision_fsdp_tp_is_close_to_fp32(reference, tmp_path):
    result = launch(_argv("llama3_fsdp2_tp2_bf16", 4), 4, out_dir=tmp_path, timeout=420)
    for step, (loss, ref) in enumerate(zip(result.ranks[0]["losses"], reference["losses"]), start=1):
        assert _relative(loss, ref) < 1e-2, f"step {step}: bf16 loss {loss!r} vs fp32 {ref!r}"
    assert result.ranks[0]["losses"] != reference["losses"]  # bf16 really ran


def test_single_process_losses_are_finite_and_fall(reference):
    assert all(math.isfinite(x) for x in reference["losses"])
    assert reference["losses"][-1] < reference["losses"][0]


USER_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}


@pytest.mark.multi_process
@pytest.mark.parametrize("recipe", ["fsdp2", "titan_dp_shard2"])
def test_users_own_module_shards_its_repeated_blocks_and_matches_one_process(recipe, tmp_path):
    single = run_single(["fit", "--recipe", "user_module:single"], out_dir=tmp_path / "single", timeout=300, env=USER_ENV)
    result = launch(["fit", "--recipe", f"user_module:{recipe}", "--trainer.devices", "2"], 2,
                    out_dir=tmp_path / "multi", timeout=300, env=USER_ENV)
    expected = single.ranks[0]["losses"]
    for rank in result.ranks:
        assert len(rank["losses"]) == 3
        for loss, ref in zip(rank["losses"], expected):
            assert _relative(loss, ref) < 1e-5
        # 4 blocks + the root
        assert rank["metrics"]["fsdp_units"] == 5.0


@pytest.mark.multi_process
@pytest.mark.slow
def test_lightning_launcher_runs_the_cli_on_four_ranks(tmp_path):
    """The README command: Lightning's own launcher re-executes titan-lightning per rank."""
    import csv
    import subprocess

    def fit(recipe, *extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "TITAN_LIGHTNING_RUN_DIR"))}
        env["CUDA_VISIBLE_DEVICES"] = ""
        folder = tmp_path / recipe
        folder.mkdir()
        subprocess.run(
            ["titan-lightning", "fit", "--recipe", f"recipes.llama3:{recipe}", "--trainer.max_steps", "3",
             "--trainer.accelerator", "cpu", "--trainer.enable_checkpointing", "false",
             "--trainer.limit_val_batches", "0", *extra],
            cwd=folder, env=env, check=True, timeout=420, capture_output=True,
        )
        (metrics,) = folder.glob("runs/*/*/csv/metrics.csv")
        return [float(r["train/loss"]) for r in csv.DictReader(open(metrics)) if r.get("train/loss")]

    single = fit("debugmodel")
    parallel = fit("fsdp2_tp2", "--trainer.devices", "4")
    assert len(parallel) == 3
    for loss, ref in zip(parallel, single):
        assert _relative(loss, ref) < 1e-5
