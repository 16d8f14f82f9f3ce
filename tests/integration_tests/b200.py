"""The `b200` suite: hardware-specific runs on Blackwell GPUs. Real PG only.

Recipes: recipes/tests/b200.py.
"""

from titan_lightning.testing.entries import TestEntry

ENTRIES = [
    TestEntry(recipes=("recipes.tests.b200:llama3_8b_fsdp8_seq16k_bf16",), name="llama3_8b_fsdp8_seq16k_bf16",
              description="Llama 3 8B, FSDP2 over 8 GPUs, 16k sequences, bf16", ngpu=8, use_real_pg=True,
              timeout=1200),
]
