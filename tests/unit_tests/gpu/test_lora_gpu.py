"""recipes.hf:lora and recipes.hf:qlora on one GPU as a user runs them (the device's choices: bf16-mixed,
compiled blocks, varlen attention): the frozen base is bf16 (LoRA) or NF4 (QLoRA) with fp32 adapters,
or bf16 computing its matmuls in float8 (LoRA with ``--job.quantize.float8.enable true``: real float8
kernels, SM89+), the adapters train (finite losses, every B moved from zero), and QLoRA's peak memory
is below LoRA's. Prints tokens/s and peak memory of each.

    pytest -m gpu tests/unit_tests/gpu/test_lora_gpu.py -s
"""

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from test_device_defaults_gpu import inputs  # noqa: F401 (the fixture: a ~0.25B Qwen 2 folder and its chats)
from titan_lightning import cli
from titan_lightning.lora import lora_layers
from titan_lightning.recipe import execute
from titan_lightning.trainer import RUN_DIR_ENV

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.slow  # (three fits on the GPU: 157 s on an H200 in run 8, the float8 variant's 20 steps 79 s of it)
@needs_gpu
def test_lora_and_qlora_train_on_one_gpu_with_a_frozen_bf16_or_nf4_base(inputs, tmp_path, monkeypatch):
    peaks = {}
    float8 = torch.cuda.get_device_capability() >= (8, 9)
    variants = [("lora", "lora", []), ("qlora", "qlora", [])] + (
        [("lora_float8", "lora", ["--job.quantize.float8.enable", "true"])] if float8 else [])
    for name, recipe, flags in variants:
        monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / name))
        argv = [f"recipes.hf:{recipe}" if arg == "recipes.hf:sft" else arg for arg in inputs]
        command, run, trainer = cli.prepare([*argv, "--trainer.max_steps", "20", "--job.data.val_fraction", "0",
                                             *flags])
        execute(command, run, trainer)
        model = trainer.lightning_module.model
        for _, layer in lora_layers(model):
            assert layer.lora_a.weight.dtype == layer.lora_b.weight.dtype == torch.float32
            assert layer.lora_b.weight.abs().max() > 0  # (zero at the start: the adapters trained on the GPU)
            kind = type(layer.weight).__name__ if recipe == "qlora" else layer.weight.dtype
            assert kind == ("NF4Tensor" if recipe == "qlora" else torch.bfloat16), kind
            assert (layer.float8 is not None) == bool(flags)
        rows = [r for r in csv.DictReader(open(next(Path(tmp_path / name).rglob("metrics.csv"))))
                if r.get("train/tokens_per_s")]
        losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
        # (Random weights and random tokens: 20 warmup-bound steps at LoRA's lr move the loss less than
        # the batches differ, as run 5 on an H200 showed, 15.40 -> 15.42; the CPU tests check the
        # adapters' numerics against PEFT exactly.)
        assert len(losses) > 10 and all(np.isfinite(losses)), losses
        peaks[name] = max(float(r["train/memory_peak_gib"]) for r in rows[-5:])
        speed = np.median([float(r["train/tokens_per_s"]) for r in rows[-10:]])
        print(f"\n{name}: {speed:,.0f} tokens/s, peak {peaks[name]:.2f} GiB, "
              f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert peaks["qlora"] < peaks["lora"]
