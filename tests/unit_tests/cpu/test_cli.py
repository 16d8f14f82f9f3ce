"""The titan-lightning command line: recipes, overrides, --print_config, bad input."""

import csv
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from titan_lightning import cli
from titan_lightning.recipe import build_run
from titan_lightning.trainer import RUN_DIR_ENV

REPO = Path(__file__).resolve().parents[3]

BAD_RECIPES = '''
from recipes.llama3 import debugmodel

def not_a_run():
    return {"module": None}

def good():
    return debugmodel()

VALUE = 3
'''


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Run in an empty folder, with a module of test recipes importable."""
    (tmp_path / "my_recipes.py").write_text(BAD_RECIPES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    return tmp_path


def test_cli_options_are_frozen():
    """New knobs belong in the config objects, not in new top-level options."""
    parser = cli.build_parser(build_run("recipes.llama3:debugmodel"))
    top_level = set()
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                top_level.add("--" + option[2:].split(".", 1)[0])
    assert top_level == {"--help", "--recipe", "--config", "--print_config", "--job", "--trainer"}
    assert set(cli.OPTIONS) == top_level - {"--help"}


def test_print_config_shows_the_resolved_run_with_overrides(workdir, capsys):
    argv = ["fit", "--recipe", "recipes.llama3:debugmodel", "--trainer.max_steps", "7",
            "--job.training.seed", "3", "--job.model.n_layers", "2", "--print_config"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "recipe: recipes.llama3:debugmodel" in printed
    assert "max_steps: 7" in printed
    assert "seed: 3" in printed
    assert "n_layers: 2" in printed
    assert not (workdir / "runs").exists()


def test_saved_config_reproduces_the_run(workdir, capsys):
    assert cli.main(["fit", "--recipe", "recipes.llama3:debugmodel", "--job.training.seed", "5",
                     "--trainer.max_steps", "30", "--print_config"]) == 0
    saved = capsys.readouterr().out
    (workdir / "run.yaml").write_text(saved)
    command, run, trainer = cli.prepare(["fit", "--config", "run.yaml"])
    assert command == "fit"
    assert run.job.training.seed == 5
    assert run.datamodule.job is run.job
    assert trainer.max_steps == 30
    assert cli.main(["fit", "--config", "run.yaml", "--print_config"]) == 0
    assert capsys.readouterr().out == saved


def test_overrides_win_over_the_recipe(workdir):
    _, run, trainer = cli.prepare(["fit", "--recipe", "recipes.llama3:debugmodel", "--trainer.max_steps", "20",
                                   "--job.optimizer.lr", "0.01", "--job.lr_schedule.warmup_steps", "2"])
    assert trainer.max_steps == 20
    assert run.job.optimizer.lr == 0.01
    assert run.module.job.lr_schedule.warmup_steps == 2
    # Untouched recipe values survive.
    assert run.job.training.seq_len == build_run("recipes.llama3:debugmodel").job.training.seq_len


def test_whole_numbers_stay_batch_counts_not_fractions(workdir):
    _, run, trainer = cli.prepare(["fit", "--recipe", "recipes.llama3:debugmodel",
                                   "--trainer.limit_val_batches", "1", "--trainer.limit_train_batches", "0.5"])
    assert run.trainer["limit_val_batches"] == 1 and isinstance(run.trainer["limit_val_batches"], int)
    assert trainer.limit_val_batches == 1
    assert trainer.limit_train_batches == 0.5


def _count_validations(monkeypatch) -> tuple[list, list]:
    """(calls of validate_job from anywhere, runs of its rules) from now on."""
    from titan_lightning.config import validation

    calls, runs = [], []
    call, check = validation.validate_job, validation._check_job
    for module in list(sys.modules.values()):  # every module that imported it by name
        if vars(module).get("validate_job") is call:
            monkeypatch.setattr(module, "validate_job", lambda job, **launch: (calls.append(launch), call(job, **launch)))
    monkeypatch.setattr(validation, "_check_job", lambda job, **launch: (runs.append(launch), check(job, **launch)))
    return calls, runs


def test_one_launch_validates_the_job_once(workdir, monkeypatch):
    """fit through the command line's own path, in process: build_trainer validates the job,
    and nothing after it (the strategy's setup, the fit) validates it again."""
    calls, runs = _count_validations(monkeypatch)
    assert cli.main(["fit", "--recipe", "recipes.llama3:debugmodel", "--trainer.max_steps", "2",
                     "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing", "false",
                     "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                     "--job.model.dim", "64", "--job.model.n_layers", "2", "--job.training.seq_len", "64",
                     "--job.training.tokens_per_microbatch_per_dp_rank", "128"]) == 0
    assert len(calls) == 1 and len(runs) == 1
    assert calls[0]["world_size"] == 1 and calls[0]["max_steps"] == 2 and calls[0]["device_type"] == "cpu"


def test_a_derived_recipe_is_validated_at_launch_only(workdir, monkeypatch):
    """A recipe that derives its run (with_cp, on_layout) leaves the validation to the launch,
    which knows the world size: once per process, before anything is spawned."""
    calls, runs = _count_validations(monkeypatch)
    _, run, trainer = cli.prepare(["fit", "--recipe", "recipes.llama3:fsdp2_cp2", "--trainer.devices", "4",
                                   "--trainer.accelerator", "cpu"])
    assert (run.job.parallelism.cp, run.job.model.attention) == (2, "allgather")
    assert len(calls) == 1 and len(runs) == 1 and calls[0]["world_size"] == 4


# Bad input (one line, exit 2, nothing written): tests/unit_tests/cpu/test_bad_input.py.


@pytest.mark.slow
def test_fit_debugmodel_end_to_end(tmp_path):
    """20 steps through the real console script: logs in one run folder, loss falls. Steps of 4
    sequences of 128 tokens (the recipe's are 8 of 256): the loss still falls by more than 1.8."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop(RUN_DIR_ENV, None)
    result = subprocess.run(
        ["titan-lightning", "fit", "--recipe", "recipes.llama3:debugmodel", "--trainer.max_steps", "20",
         "--trainer.log_every_n_steps", "1", "--trainer.val_check_interval", "20", "--trainer.limit_val_batches", "2",
         "--trainer.enable_checkpointing", "false", "--job.lr_schedule.warmup_steps", "2",
         "--job.training.seq_len", "128", "--job.training.tokens_per_microbatch_per_dp_rank", "512"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_folder,) = (tmp_path / "runs" / "llama3_debugmodel").iterdir()
    assert list((run_folder / "tensorboard").glob("events.out.tfevents.*"))
    rows = list(csv.DictReader(open(run_folder / "csv" / "metrics.csv")))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 20
    assert losses[-1] < losses[0] - 1.0
    assert any(r.get("train/tokens_per_s") for r in rows)
    assert any(r.get("train/lr") for r in rows)
    assert any(r.get("val/ppl") for r in rows)
