"""Preference training on one GPU (recipes.hf:dpo with the device's defaults: bf16, compiled blocks,
varlen attention over the packed answers): step 1's DPO loss is log 2 (the precomputed reference is
the starting model), the held-out pairs are validated, and with LoRA the reference taken each step
with the adapters off gives the losses of the precomputed one. The CPU tests
(tests/unit_tests/cpu/test_preference.py) check the numerics in fp32 against transformers."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "cpu"))

import preference_cases as cases  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return cases.make_folders(tmp_path_factory.mktemp("dpo_gpu"))


def test_dpo_on_one_gpu_starts_at_log_2_and_validates_the_held_out_pairs(folders, tmp_path):
    folder, data = folders
    run = cases.dpo_run(folder=str(folder), data=str(data), run_dir=str(tmp_path / "run"), accelerator="cuda")
    first, second = run["steps"]
    assert first["train/loss"] == pytest.approx(math.log(2), abs=5e-3)
    assert math.isfinite(second["train/loss"]) and second["train/loss"] != first["train/loss"]
    assert 0 <= run["val"]["val/rewards/accuracies"] <= 1 and math.isfinite(run["val"]["val/loss"])


def test_with_lora_adapters_off_gives_the_precomputed_reference_s_losses(folders, tmp_path):
    folder, data = folders
    runs = [cases.dpo_run(folder=str(folder), data=str(data), run_dir=str(tmp_path / reference), lora_rank=4,
                          reference=reference, accelerator="cuda") for reference in ("precomputed", "adapters_off")]
    for got, want in zip(runs[1]["steps"], runs[0]["steps"]):
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-2, abs=1e-3)
