"""tests/lightning_upstream/run.py changes exactly one line of Lightning's test file, its import."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

RUN = Path(__file__).parents[2] / "lightning_upstream" / "run.py"


def _runner():
    spec = importlib.util.spec_from_file_location("lightning_upstream_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checkout(root: Path, test_text: str) -> Path:
    """A git repository holding the paths run.py takes, tagged 2.6.0."""
    for path in ("tests/tests_pytorch/__init__.py", "tests/tests_pytorch/conftest.py",
                 "tests/tests_pytorch/helpers/__init__.py", "tests/tests_pytorch/strategies/__init__.py"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("# Licensed under the Apache License, Version 2.0\n")
    (root / "tests/tests_pytorch/strategies/test_model_parallel_integration.py").write_text(test_text)
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "tests"], check=True)
    subprocess.run([*git, "tag", "2.6.0"], check=True)
    return root


def test_the_copy_differs_from_lightnings_file_in_the_import_alone(tmp_path):
    run = _runner()
    text = ("# Copyright The Lightning AI team.\nimport torch\n" + run.LIGHTNING_IMPORT +
            "\n\ndef test_x():\n    ModelParallelStrategy(data_parallel_size=1)\n")
    repo = _checkout(tmp_path / "lightning", text)
    copy = run.extract(repo, "2.6.0", tmp_path / "build", control=False).read_text()
    assert copy == text.replace(run.LIGHTNING_IMPORT, "from titan_lightning.strategies import TitanStrategy as "
                                                      "ModelParallelStrategy\n")
    assert (tmp_path / "build" / "tests/tests_pytorch/conftest.py").is_file()
    assert run.extract(repo, "2.6.0", tmp_path / "control", control=True).read_text() == text


def test_a_file_without_the_import_is_refused(tmp_path):
    run = _runner()
    repo = _checkout(tmp_path / "lightning", "from lightning.pytorch.strategies import FSDPStrategy\n")
    with pytest.raises(SystemExit, match="expected the line 'from lightning.pytorch.strategies import "
                                         "ModelParallelStrategy' once"):
        run.extract(repo, "2.6.0", tmp_path / "build", control=False)
