"""recipes.hf:lora and recipes.hf:qlora on one GPU as a user runs them (the device's choices: bf16-mixed,
compiled blocks, varlen attention): the frozen base is bf16 (LoRA) or NF4 (QLoRA) with fp32 adapters,
the loss falls, and QLoRA's peak memory is below LoRA's. Prints tokens/s and peak memory of each.

    pytest -m gpu tests/unit_tests/gpu/test_lora_gpu.py -s
"""

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_lightning import cli
from titan_lightning.data.shards import tokenizer_identity
from titan_lightning.data.tokenizer import load_tokenizer
from titan_lightning.lora import lora_layers
from titan_lightning.recipe import execute
from titan_lightning.testing.sft_shards import synthetic_conversations, write_sft_shards
from titan_lightning.trainer import RUN_DIR_ENV

from tests.hf_folders import save_hf_folder

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# A Qwen 2 folder of ~0.25B parameters (every linear's size a multiple of NF4's blocks).
SHAPE = dict(vocab_size=32768, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=2,
             intermediate_size=2816, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_gpu")
    folder = save_hf_folder(root / "model", "qwen2", **SHAPE)
    tokenizer = load_tokenizer(str(folder))
    identity = tokenizer_identity(folder / "tokenizer.json", tokenizer.vocab_size, tokenizer.eot_id,
                                  tokenizer.bos_id if tokenizer.add_bos else None)
    conversations = [(np.where(t == 0, tokenizer.eot_id, t % (tokenizer.vocab_size - 1)), m)
                     for t, m in synthetic_conversations(600, seed=0, mean_turn=120, max_turns=3)]
    write_sft_shards(root / "sft", conversations, tokenizer=identity)
    return ["--job.checkpoint.initial_load_path", str(folder), "--job.data.dataset_path", str(root / "sft"),
            "--trainer.accelerator", "gpu", "--trainer.devices", "1", "--trainer.log_every_n_steps", "1",
            "--trainer.max_steps", "20", "--trainer.max_epochs", "-1", "--job.data.val_fraction", "0"]


@needs_gpu
def test_lora_and_qlora_train_on_one_gpu_with_a_frozen_bf16_or_nf4_base(inputs, tmp_path, monkeypatch):
    peaks = {}
    for recipe in ("lora", "qlora"):
        monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / recipe))
        command, run, trainer = cli.prepare(["fit", "--recipe", f"recipes.hf:{recipe}", *inputs])
        execute(command, run, trainer)
        model = trainer.lightning_module.model
        for _, layer in lora_layers(model):
            assert layer.lora_a.weight.dtype == layer.lora_b.weight.dtype == torch.float32
            kind = type(layer.weight).__name__ if recipe == "qlora" else layer.weight.dtype
            assert kind == ("NF4Tensor" if recipe == "qlora" else torch.bfloat16), kind
        rows = [r for r in csv.DictReader(open(next(Path(tmp_path / recipe).rglob("metrics.csv"))))
                if r.get("train/tokens_per_s")]
        losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
        assert losses[-1] < losses[0], losses
        peaks[recipe] = max(float(r["train/memory_peak_gib"]) for r in rows[-5:])
        speed = np.median([float(r["train/tokens_per_s"]) for r in rows[-10:]])
        print(f"\n{recipe}: {speed:,.0f} tokens/s, peak {peaks[recipe]:.2f} GiB, "
              f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert peaks["qlora"] < peaks["lora"]
