"""A run prints nothing a user cannot act on: no warning of ours or Lightning's (the expected ones
are hidden in one place, titan_lightning/_compat.py), no tip, no torchao loaded with float8 off;
a logger whose package is missing is one line naming the pip install."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from titan_lightning import cli
from titan_lightning.trainer import RUN_DIR_ENV

# What a warning looks like on stderr: Python's and Lightning's "file.py:12: ..." lines, a category
# ("UserWarning: ..."), torch's C++ "W1204 12:00:00.000 ..." lines, Lightning's tips.
WARNING_LINE = re.compile(r"\.py:\d+: |Warning|warn\(|^W\d{4} |Tip:|Failed to load")

# The entry point as the console script runs it; then which modules the run loaded.
FIT = ("import sys; from titan_lightning.entry import main; rc = main(sys.argv[1:]); "
       "print('loaded:', sorted(m for m in ('torchao', 'wandb') if m in sys.modules)); sys.exit(rc)")


@pytest.mark.slow  # an end-to-end run: ~15 s of CPU
def test_a_short_fit_prints_no_warning(tmp_path):
    """Two steps of the debug model, validated (sanity check and a last validation) and saved."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **{RUN_DIR_ENV: str(tmp_path / "run")})
    argv = ["fit", "--recipe", "recipes.llama3:debugmodel", "--trainer.max_steps", "2", "--trainer.val_check_interval",
            "2", "--trainer.limit_val_batches", "1", "--job.lr_schedule.warmup_steps", "0", "--job.training.seq_len",
            "64", "--job.training.tokens_per_microbatch_per_dp_rank", "128", "--trainer.enable_progress_bar", "false"]
    result = subprocess.run([sys.executable, "-c", FIT, *argv], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if WARNING_LINE.search(line)]
    assert warnings == [], "\n".join(warnings)
    assert "loaded: []" in result.stdout  # float8 is off: torchao is never imported
    assert list((tmp_path / "run" / "checkpoints").iterdir())


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "needs_a_package.py").write_text(
        "from lightning.pytorch.callbacks import Callback\n\n"
        "class Uploads(Callback):\n"
        "    def __init__(self):\n"
        "        import no_such_package_for_uploads.client  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    return tmp_path


@pytest.mark.parametrize("option, class_path, line", [
    ("--trainer.logger", "lightning.pytorch.loggers.WandbLogger",
     "--trainer.logger WandbLogger needs the wandb package: pip install wandb"),
    ("--trainer.callbacks+", "needs_a_package.Uploads",
     "--trainer.callbacks Uploads needs the no_such_package_for_uploads package: pip install no_such_package_for_uploads"),
], ids=["wandb logger", "a callback's package"])
def test_a_class_whose_package_is_missing_is_one_line(option, class_path, line, workdir, capfd):
    if class_path.endswith("WandbLogger") and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here: its logger builds")
    assert cli.main(["fit", "--recipe", "recipes.llama3:debugmodel", option, class_path]) == 2
    assert capfd.readouterr().err == f"titan-lightning: error: {line}\n"
    assert not (workdir / "runs").exists()
