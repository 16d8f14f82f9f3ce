"""Lightning's tensor-parallel example (lightning_tp_example.py) under TitanStrategy with only the
strategy's class changed: the same loss at each of 8 steps as under ModelParallelStrategy, on 4
gloo ranks (2 data-parallel x 2 tensor-parallel)."""

from pathlib import Path

import pytest

from titan_lightning.testing.launch import launch, pythonpath_env

ENV = pythonpath_env(Path(__file__).parent)


def _fit(recipe: str, out: Path) -> list[dict]:
    argv = ["fit", "--recipe", f"lightning_tp_example:{recipe}", "--trainer.devices", "4"]
    return launch(argv, 4, out_dir=out, timeout=300, env=ENV).ranks


@pytest.mark.multi_process
def test_lightnings_tensor_parallel_example_gives_the_same_losses_under_titan_strategy(tmp_path):
    (expected, *others) = _fit("model_parallel", tmp_path / "model_parallel")
    assert all(rank["losses"] == expected["losses"] for rank in others)  # (logged synced over the ranks)
    assert expected["steps"] == list(range(1, 9)) and len(set(expected["losses"])) == 8
    for rank in _fit("titan", tmp_path / "titan"):
        assert rank["steps"] == expected["steps"]
        for got, want in zip(rank["losses"], expected["losses"], strict=True):
            assert abs(got - want) <= 1e-6 * abs(want), (rank["losses"], expected["losses"])
