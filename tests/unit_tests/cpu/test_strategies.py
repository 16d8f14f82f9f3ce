"""TitanStrategy with real processes: a user's own module, Lightning's own launcher.

Every parallel layout of the Llama 3 debug model is checked against the single-process
run by the real-PG integration suite (tests/integration_tests/test_features.py).

Multi-process tests start one real process per rank (gloo on CPU) through
titan_lightning.testing.launch, each with a hard timeout; none outlives its test.
"""

import math
import os
from pathlib import Path

import pytest

from titan_lightning.testing.launch import launch, pythonpath_env, run_single

STEPS = 5
FIT = ["fit", "--trainer.accelerator", "cpu", "--trainer.max_steps", str(STEPS)]
# The debug model at width 64, and also cut to 2 blocks of 64 tokens: for tests of a launch or a
# schedule, not of the model's size.
NARROW = ["--job.model.dim", "64", "--job.model.n_heads", "4", "--job.model.n_kv_heads", "4"]
SMALL_MODEL = [*NARROW, "--job.model.n_layers", "2", "--job.training.seq_len", "64"]


def _argv(recipe: str, world_size: int) -> list[str]:
    return [*FIT, "--recipe", f"recipes.tests.features:{recipe}", "--trainer.devices", str(world_size)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process debug-model run."""
    result = run_single(_argv("llama3_debugmodel", 1), out_dir=tmp_path_factory.mktemp("reference"), timeout=300)
    return result.ranks[0]


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_single_process_losses_are_finite_and_fall(reference):
    assert all(math.isfinite(x) for x in reference["losses"])
    assert reference["losses"][-1] < reference["losses"][0]


USER_ENV = pythonpath_env(Path(__file__).parent)


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
    import signal
    import subprocess

    common = ["--trainer.max_steps", "3", "--trainer.accelerator", "cpu", "--trainer.enable_checkpointing", "false",
              "--trainer.limit_val_batches", "0", *SMALL_MODEL]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "TITAN_LIGHTNING_RUN_DIR"))}
    env["CUDA_VISIBLE_DEVICES"] = ""
    folder = tmp_path / "fsdp2_tp2"
    folder.mkdir()
    with open(tmp_path / "fsdp2_tp2.log", "wb") as log:
        launcher = subprocess.Popen(
            ["titan-lightning", "fit", "--recipe", "recipes.llama3:fsdp2_tp2", *common,
             "--job.training.tokens_per_microbatch_per_dp_rank", "128", "--trainer.devices", "4"],
            cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        # The one-process reference, while the launcher imports: the same global batch, 4 sequences
        # on one process, 2 on each of the 2 data-parallel ranks.
        single = run_single(["fit", "--recipe", "recipes.llama3:debugmodel", *common,
                             "--job.training.tokens_per_microbatch_per_dp_rank", "256"],
                            out_dir=tmp_path / "single", timeout=300).ranks[0]["losses"]
        status = launcher.wait(timeout=420)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)  # the ranks it started are in its process group
        launcher.wait()
    assert status == 0, (tmp_path / "fsdp2_tp2.log").read_text(errors="replace")[-3000:]
    (metrics,) = folder.glob("runs/*/*/csv/metrics.csv")
    parallel = [float(r["train/loss"]) for r in csv.DictReader(open(metrics)) if r.get("train/loss")]
    assert len(parallel) == 3
    for loss, ref in zip(parallel, single):
        assert _relative(loss, ref) < 1e-5


@pytest.mark.multi_process
def test_users_own_module_trains_and_validates_on_two_pipeline_stages(tmp_path):
    """The same training_step, split over 2 stages: losses match one process; validation
    (sanity check included) runs forward-only and every rank logs the last stage's numbers."""
    single = run_single(["fit", "--recipe", "user_module:pipeline_single"], out_dir=tmp_path / "single", timeout=300,
                        env=USER_ENV)
    result = launch(["fit", "--recipe", "user_module:pipeline_pp2", "--trainer.devices", "2"], 2,
                    out_dir=tmp_path / "pp2", timeout=300, env=USER_ENV)
    expected = single.ranks[0]
    for rank in result.ranks:
        assert len(rank["losses"]) == 3
        for loss, ref in zip(rank["losses"], expected["losses"]):
            assert _relative(loss, ref) < 1e-6
        assert _relative(rank["metrics"]["val/loss"], expected["metrics"]["val/loss"]) < 1e-6


@pytest.mark.multi_process
def test_pipeline_without_a_plan_names_the_missing_attribute(tmp_path):
    from titan_lightning.testing.launch import LaunchFailed

    with pytest.raises(LaunchFailed) as failed:
        launch(["fit", "--recipe", "user_module:pipeline_no_plan", "--trainer.devices", "2"], 2,
               out_dir=tmp_path / "pp2", timeout=300, env=USER_ENV)
    assert "declares none: give it a `pipeline_plan" in str(failed.value) + "".join(
        p.read_text() for p in (tmp_path / "pp2").glob("rank*.error"))


@pytest.mark.multi_process
def test_pipeline_validation_loss_matches_one_process(tmp_path):
    """Validation under PP runs a forward-only schedule; the torchmetrics mean that only the last
    stage updates, synced over every rank, equals the one-process validation loss and perplexity."""
    extra = ["--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "3", "--trainer.max_steps", "3",
             *NARROW]
    single = run_single([*_argv("llama3_debugmodel", 1), *extra], out_dir=tmp_path / "single", timeout=300)
    result = launch([*_argv("llama3_pp2_interleaved", 2), *extra], 2, out_dir=tmp_path / "pp2", timeout=300)
    expected = single.ranks[0]["metrics"]
    for rank in result.ranks:
        for name in ("val/loss", "val/ppl"):
            assert _relative(rank["metrics"][name], expected[name]) < 1e-6, (name, rank["metrics"][name], expected[name])


@pytest.mark.multi_process
def test_pipeline_without_fsdp_computes_in_bf16_when_asked(tmp_path):
    """bf16-mixed under PP with no FSDP autocasts the stages, as one device autocasts the model
    (the schedule calls the stage modules, not the LightningModule's forward)."""
    result = launch(["fit", "--recipe", "user_module:llama3_pp2_bf16", "--trainer.devices", "2",
                     "--trainer.accelerator", "cpu"], 2, out_dir=tmp_path, timeout=300, env=USER_ENV)
    assert [rank["metrics"]["probe/bf16"] for rank in result.ranks] == [1.0, 1.0]
