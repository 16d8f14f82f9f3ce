"""generate / chat on a run's checkpoint with no run options: fit writes the run as --print_config
prints it into <run folder>/config.yaml at launch, and generate rebuilds the job from it; the
tokens are those of generate given the run's options. A missing or unreadable file: one line."""

import io
from pathlib import Path

import pytest

from titan_lightning import cli
from titan_lightning.generate import find_model
from titan_lightning.trainer import RUN_DIR_ENV

from tests.hf_folders import folder_and_conversations

GENERATE = ["--prompt", "Once upon", "--greedy", "--max-new-tokens", "6"]


def _fit(recipe: str, folder: Path, data: Path, run_dir: Path, monkeypatch) -> tuple[list[str], list[str]]:
    """A 2-step fit: its options, and those generate needs again without config.yaml."""
    options = ["--recipe", recipe, "--job.checkpoint.initial_load_path", str(folder),
               "--job.data.dataset_path", str(data)]
    argv = [*options, "--trainer.accelerator", "cpu", "--trainer.max_steps", "2", "--trainer.max_epochs", "-1",
            "--trainer.enable_progress_bar", "false", "--job.checkpoint.interval", "2", "--job.data.val_fraction", "0",
            "--job.training.tokens_per_step", "256", "--job.training.tokens_per_microbatch_per_dp_rank", "128",
            "--job.checkpoint.export_format", "null"]
    monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))
    assert cli.main(["fit", *argv]) == 0
    return argv, options


def _generate(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code = cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("recipe", ["recipes.hf:sft", "recipes.hf:lora"])
def test_a_checkpoint_generates_from_its_runs_config(recipe, tmp_path, monkeypatch, capsys):
    folder, data = folder_and_conversations(tmp_path, "qwen3")
    run_dir = tmp_path / "run"
    argv, options = _fit(recipe, folder, data, run_dir, monkeypatch)
    config = run_dir / "config.yaml"
    # the file round-trips: --config gives the run the command line gave
    recorded, given = cli.parse_run(["--config", str(config)]), cli.parse_run(argv)
    assert (recorded.job, recorded.trainer) == (given.job, given.trainer)
    assert not list(run_dir.glob(".config.yaml.*"))  # (written whole)
    checkpoint = run_dir / "checkpoints" / "epoch=0-step=2.ckpt"
    capsys.readouterr()

    explicit = _generate(["--model", str(checkpoint), *GENERATE, *options], monkeypatch, capsys)
    assert explicit[0] == 0 and explicit[1].strip()
    assert _generate(["--model", str(checkpoint), *GENERATE], monkeypatch, capsys)[:2] == explicit[:2]
    assert _generate(["--model", str(run_dir), *GENERATE], monkeypatch, capsys)[:2] == explicit[:2]  # (no export)
    if recipe == "recipes.hf:lora":  # options given after ours go on top of the file's
        alpha = find_model(str(checkpoint), [], cli.parse_run).lora.alpha
        assert find_model(str(checkpoint), ["--job.lora.alpha", str(alpha + 1)], cli.parse_run).lora.alpha == alpha + 1
        return

    config.write_text("recipe: [unclosed\n")
    code, out, err = _generate(["--model", str(checkpoint), *GENERATE], monkeypatch, capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert str(config) in err and "--recipe" in err
    config.unlink()
    code, out, err = _generate(["--model", str(checkpoint), *GENERATE], monkeypatch, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "config.yaml" in err and "--recipe" in err
