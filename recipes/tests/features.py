"""Runs the `features` integration suite trains (entries live in tests/integration_tests/).

Small, deterministic and quick on 2 CPU cores: 10 steps of the Llama 3 debug model.
"""

from recipes.llama3 import llama3
from titan_lightning.config import LRScheduleConfig, TrainingConfig
from titan_lightning.recipe import Run


def llama3_debugmodel() -> Run:
    """One rank, fp32, deterministic: the baseline every parallel layout is compared with."""
    run = llama3(
        "debugmodel",
        training=TrainingConfig(seq_len=128, tokens_per_microbatch_per_dp_rank=512, deterministic=True, seed=0),
        lr_schedule=LRScheduleConfig(warmup_steps=1),
    )
    run.trainer.update(
        max_steps=10, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    return run


def llama3_debugmodel_accumulation() -> Run:
    """Two microbatches per optimizer step, derived from tokens_per_step."""
    run = llama3_debugmodel()
    run.job.training.tokens_per_step = 2 * run.job.training.tokens_per_microbatch_per_dp_rank
    return run


def llama3_debugmodel_bf16() -> Run:
    """fp32 parameters, bf16 compute (autocast on one device)."""
    run = llama3_debugmodel()
    run.job.training.mixed_precision_param = "bfloat16"
    return run
