"""Runs the `b200` hardware suite trains: Blackwell GPUs (real PG only), longer sequences per GPU."""

from recipes.llama3 import llama3_8b
from recipes.tests.h100 import short
from titan_lightning.recipe import Run


def llama3_8b_fsdp8_seq16k_bf16() -> Run:
    """Llama 3 8B on FSDP2 over 8 GPUs at 16,384-token sequences (B200 memory)."""
    run = llama3_8b()
    run.job.training.seq_len = run.job.training.tokens_per_microbatch_per_dp_rank = 16384
    return short(run, dp_shard=8)
