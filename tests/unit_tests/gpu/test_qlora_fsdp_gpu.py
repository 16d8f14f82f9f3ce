"""recipes.hf:qlora on two GPUs under FSDP2 as a user runs it (the device's choices: bf16-mixed,
compiled blocks, varlen attention): each rank holds its rows of the NF4 base, the per-step losses are
one GPU's (the same 2 windows a step; bf16: 2e-2), and a rank's peak memory is below one GPU's.
Prints tokens/s and peak memory of each.

    pytest -m multi_gpu tests/unit_tests/gpu/test_qlora_fsdp_gpu.py -s
"""

import csv
import os
from pathlib import Path

import pytest
import torch

from test_device_defaults_gpu import inputs  # noqa: F401 (the fixture: a ~0.25B Qwen 2 folder and its chats)
from titan_lightning.testing.launch import launch
from titan_lightning.trainer import RUN_DIR_ENV

pytestmark = pytest.mark.multi_gpu
needs_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
GPUS = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")


def _fit(inputs, tmp_path: Path, name: str, gpus: int) -> tuple[list[float], float, float]:
    """(losses, median tokens/s of the last 10 steps per GPU, peak GiB) of 20 steps on ``gpus`` GPUs."""
    argv = ["recipes.hf:qlora" if arg == "recipes.hf:sft" else arg for arg in inputs]
    argv[argv.index("--trainer.devices") + 1] = str(gpus)
    seq_len = 2048  # (recipes.hf:sft's window for this folder)
    argv += ["--trainer.max_steps", "20", "--job.data.val_fraction", "0", "--job.parallelism.dp_shard", str(gpus),
             "--job.training.tokens_per_step", str(2 * seq_len)]
    out = tmp_path / name
    launch(argv, gpus, out_dir=out, timeout=900,
           env={"CUDA_VISIBLE_DEVICES": ",".join(GPUS[:gpus]), RUN_DIR_ENV: str(out / "run")})
    rows = [r for r in csv.DictReader(open(next(out.rglob("metrics.csv")))) if r.get("train/tokens_per_s")]
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    speeds = sorted(float(r["train/tokens_per_s"]) for r in rows[-10:])
    return losses, speeds[len(speeds) // 2], max(float(r["train/memory_peak_gib"]) for r in rows[-5:])


@needs_gpus
def test_qlora_under_fsdp2_on_two_gpus_trains_as_one_gpu_in_less_memory_a_rank(inputs, tmp_path):
    one, two = _fit(inputs, tmp_path, "one", 1), _fit(inputs, tmp_path, "two", 2)
    for name, (losses, speed, peak) in (("1 GPU", one), ("FSDP2 x 2", two)):
        print(f"\nqlora, {name}: {speed:,.0f} tokens/s a GPU, peak {peak:.2f} GiB, loss {losses[0]:.3f} -> "
              f"{losses[-1]:.3f}")
    assert len(one[0]) == len(two[0]) == 20 and one[0][-1] < one[0][0]
    torch.testing.assert_close(torch.tensor(two[0]), torch.tensor(one[0]), rtol=2e-2, atol=2e-2)
    assert two[2] < one[2]
