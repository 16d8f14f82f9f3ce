"""recipes.hf:sft on one GPU with no tuning flags (titan_lightning/device_defaults.py): the run
chooses bf16-mixed, compiled blocks, varlen attention and the window and microbatch the estimator
fits, says so in one line, trains, and stays under the memory it estimated. Prints the choice and
the measured tokens/s, MFU and peak memory of the last steps.

    pytest -m gpu tests/unit_tests/gpu/test_device_defaults_gpu.py -s
"""

import csv

import pytest
import torch

from titan_lightning import cli, device_defaults
from titan_lightning.recipe import execute
from titan_lightning.testing.sft_shards import synthetic_conversations, write_sft_shards
from titan_lightning.trainer import RUN_DIR_ENV

from tests.hf_folders import save_hf_model

pytestmark = pytest.mark.gpu

# A Qwen 2 folder of ~0.25B parameters and 8192 positions, without a tokenizer (the run then reads
# the shipped one, which the synthetic conversations use).
SHAPE = dict(vocab_size=32768, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=2,
             intermediate_size=2816, max_position_embeddings=8192)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_sft_recipe_chooses_for_the_gpu_and_trains_within_its_estimate(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    save_hf_model(tmp_path / "model", "qwen2", **SHAPE)
    write_sft_shards(tmp_path / "sft", synthetic_conversations(3000, seed=0, mean_turn=120, max_turns=3))
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
