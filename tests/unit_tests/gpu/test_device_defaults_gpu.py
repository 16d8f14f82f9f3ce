"""recipes.hf:sft on one GPU with no tuning flags (titan_lightning/device_defaults.py): the run
chooses bf16-mixed, compiled blocks, varlen attention and the window and microbatch the estimator
fits, says so in one line, trains, and stays under the memory it estimated. Prints the choice and
the measured tokens/s, MFU and peak memory of the last steps.

    pytest -m gpu tests/unit_tests/gpu/test_device_defaults_gpu.py -s
"""

import csv

import numpy as np
import pytest
import torch

from titan_lightning import cli, device_defaults
from titan_lightning.data.shards import tokenizer_identity
from titan_lightning.data.tokenizer import load_tokenizer
from titan_lightning.recipe import execute
from titan_lightning.testing.sft_shards import synthetic_conversations, write_sft_shards
from titan_lightning.trainer import RUN_DIR_ENV

from tests.hf_folders import save_hf_folder

pytestmark = pytest.mark.gpu

# A Qwen 2 folder of ~0.25B parameters and 8192 positions, with a small trained tokenizer.
SHAPE = dict(vocab_size=32768, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=2,
             intermediate_size=2816, max_position_embeddings=8192)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_sft_recipe_chooses_for_the_gpu_and_trains_within_its_estimate(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    folder = save_hf_folder(tmp_path / "model", "qwen2", **SHAPE)
    tokenizer = load_tokenizer(str(folder))
    identity = tokenizer_identity(folder / "tokenizer.json", tokenizer.vocab_size, tokenizer.eot_id,
                                  tokenizer.bos_id if tokenizer.add_bos else None)
    conversations = [(np.where(t == 0, tokenizer.eot_id, t % (tokenizer.vocab_size - 1)), m)
                     for t, m in synthetic_conversations(3000, seed=0, mean_turn=120, max_turns=3)]
    write_sft_shards(tmp_path / "sft", conversations, tokenizer=identity)
    argv = ["fit", "--recipe", "recipes.hf:sft", "--job.checkpoint.initial_load_path", str(tmp_path / "model"),
            "--job.data.dataset_path", str(tmp_path / "sft"), "--trainer.accelerator", "gpu",
            "--trainer.devices", "1", "--trainer.max_steps", "12", "--trainer.log_every_n_steps", "1",
            "--job.checkpoint.export_format", "null"]
    command, run, trainer = cli.prepare(argv)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("titan-lightning: on ")]
    assert len(lines) == 1, lines
    print("\n" + lines[0])
    job = run.job
    assert (job.training.dtype, job.training.mixed_precision_param) == ("float32", "bfloat16")
    assert job.compile.enable and job.model.attention == "varlen"
    assert job.training.seq_len == device_defaults.SEQ_LEN
    assert job.training.tokens_per_microbatch_per_dp_rank == device_defaults.TOKENS_PER_MICROBATCH
    execute(command, run, trainer)
    rows = list(csv.DictReader(open(next((tmp_path / "runs").rglob("metrics.csv")))))
    last = [r for r in rows if r.get("train/tokens_per_s")][-3:]
    for r in last:
        print(f"step {r['step']}: {float(r['train/tokens_per_s']):,.0f} tokens/s, "
              f"MFU {r.get('train/mfu') or '-'}, peak {float(r['train/memory_peak_gib']):.1f} GiB")
    estimated = float(lines[0].split("estimated peak ")[1].split(" GiB")[0])
    assert max(float(r["train/memory_peak_gib"]) for r in last) <= 1.25 * estimated + 1
