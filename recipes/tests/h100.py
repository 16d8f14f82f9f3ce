"""Runs the `h100` hardware suite trains: published Llama 3 shapes in bf16 on Hopper GPUs (real PG only).

Short runs (10 steps, no checkpoints) that exercise what the CPU suites cannot: NCCL,
SDPA flash attention, FSDP mixed precision at 8,192-token sequences, full-size vocabularies.
Each data-parallel rank gets one 8,192-token sequence per step.
"""

from recipes.llama3 import llama3_1b, llama3_3b, llama3_8b
from titan_lightning.recipe import Run


def short(run: Run, **degrees) -> Run:
    """10 deterministic steps of ``run`` on the given layout, nothing written."""
    for name, value in degrees.items():
        setattr(run.job.parallelism, name, value)
    run.job.training.deterministic = True
    run.job.lr_schedule.warmup_steps = 2
    run.trainer.update(
        max_steps=10, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    return run


def llama3_1b_bf16() -> Run:
    """Llama 3 1B, one GPU, bf16 autocast over fp32 parameters."""
    return short(llama3_1b())


def llama3_1b_fsdp8_bf16() -> Run:
    """Llama 3 1B on FSDP2 over 8 GPUs, bf16 compute and fp32 reduce."""
    return short(llama3_1b(), dp_shard=8)


def llama3_3b_fsdp4_tp2_bf16() -> Run:
    """Llama 3 3B on FSDP4 x TP2 (8 GPUs) with sequence and loss parallel."""
    return short(llama3_3b(), dp_shard=4, tp=2)


def llama3_8b_fsdp8_bf16() -> Run:
    """Llama 3 8B on FSDP2 over 8 GPUs."""
    return short(llama3_8b(), dp_shard=8)
