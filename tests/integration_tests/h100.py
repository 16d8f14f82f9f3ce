"""The `h100` suite: hardware-specific runs on Hopper GPUs (H100/H200). Real PG only.

Recipes: recipes/tests/h100.py.
"""

from titan_lightning.testing.entries import TestEntry

_R = "recipes.tests.h100"

ENTRIES = [
    TestEntry(recipes=(f"{_R}:llama3_1b_bf16",), name="llama3_1b_bf16",
              description="Llama 3 1B, one GPU, bf16, seq 8192", ngpu=1, use_real_pg=True),
    TestEntry(recipes=(f"{_R}:llama3_1b_fsdp8_bf16",), name="llama3_1b_fsdp8_bf16",
              description="Llama 3 1B, FSDP2 over 8 GPUs, bf16", ngpu=8, use_real_pg=True),
    TestEntry(recipes=(f"{_R}:llama3_3b_fsdp4_tp2_bf16",), name="llama3_3b_fsdp4_tp2_bf16",
              description="Llama 3 3B, FSDP4 x TP2, bf16", ngpu=8, use_real_pg=True),
    TestEntry(recipes=(f"{_R}:llama3_8b_fsdp8_bf16",), name="llama3_8b_fsdp8_bf16",
              description="Llama 3 8B, FSDP2 over 8 GPUs, bf16", ngpu=8, use_real_pg=True, timeout=1200),
]
