"""A non-editable install trains the quickstart recipe from any folder: the shipped corpus and
tokenizer are package data and the recipes are installed (a wheel built from this checkout's
tracked files into a fresh venv; torch and the other dependencies come from the system site)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

# The checkout's own editable install (a finder the system site adds) is hidden in the venv, so
# only the wheel's files can be imported there.
HIDE_EDITABLE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
sys.path_importer_cache.clear()
"""


def _tracked_copy(destination: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())


@pytest.mark.slow
def test_a_non_editable_install_trains_the_quickstart_from_any_folder(tmp_path):
    if not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to know which files are the package's sources")
    source, venv, elsewhere = tmp_path / "src", tmp_path / "venv", tmp_path / "elsewhere"
    _tracked_copy(source)
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # Nothing of the checkout on the path, and no run folder another test may have left exported.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TITAN_LIGHTNING_RUN_DIR")}
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, env=env).stdout.strip()
    (Path(purelib) / "sitecustomize.py").write_text(HIDE_EDITABLE)
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", str(source)],
                   check=True, timeout=600, cwd=elsewhere, env=env)
    where = subprocess.run([python, "-c", "import titan_lightning, recipes; print(titan_lightning.__file__)"],
                           capture_output=True, text=True, check=True, cwd=elsewhere, env=env).stdout.strip()
    assert where.startswith(purelib), where
    run = subprocess.run(
        [venv / "bin" / "titan-lightning", "fit", "--recipe", "recipes.llama3:debugmodel", "--trainer.max_steps", "2",
         "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false"],
        capture_output=True, text=True, timeout=600, cwd=elsewhere, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in run.stdout + run.stderr
    assert list((elsewhere / "runs").glob("llama3_debugmodel/*"))  # its run folder is where it was started
