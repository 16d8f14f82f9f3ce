"""The `features` suite: depth, the parallelisms composed on the Llama 3 debug model.

Recipes: recipes/tests/features.py. Every layout's seed run is the single-process one.
"""

from titan_lightning.testing.entries import TestEntry

_R = "recipes.tests.features"
_SEED = f"{_R}:llama3_debugmodel"


def _layout(recipe: str, ngpu: int, description: str) -> TestEntry:
    return TestEntry(recipes=(f"{_R}:{recipe}",), name=recipe, description=description, ngpu=ngpu, seed_recipe=_SEED)


ENTRIES = [
    TestEntry(recipes=(_SEED,), name="llama3_debugmodel", description="one process, fp32, deterministic"),
    TestEntry(recipes=(f"{_R}:llama3_debugmodel_accumulation",), name="llama3_debugmodel_accumulation",
              description="two microbatches per step from tokens_per_step"),
    TestEntry(recipes=(f"{_R}:llama3_debugmodel_bf16",), name="llama3_debugmodel_bf16",
              description="bf16 autocast over fp32 parameters"),
    _layout("llama3_fsdp2", 2, "FSDP2 over 2 ranks"),
    _layout("llama3_fsdp4", 4, "FSDP2 over 4 ranks"),
    _layout("llama3_ddp2", 2, "DDP over 2 ranks"),
    _layout("llama3_ddp4", 4, "DDP over 4 ranks"),
    _layout("llama3_hsdp2x2", 4, "HSDP: 2 replicas of FSDP2"),
    _layout("llama3_tp2", 2, "TP2 with sequence and loss parallel"),
    _layout("llama3_tp4", 4, "TP4 with sequence and loss parallel"),
    _layout("llama3_tp2_no_sp", 2, "TP2 without sequence parallel"),
    _layout("llama3_tp4_no_sp", 4, "TP4 without sequence parallel"),
    _layout("llama3_fsdp2_tp2", 4, "FSDP2 x TP2"),
    _layout("llama3_hsdp2x2_tp2", 8, "2 replicas of FSDP2 x TP2"),
    _layout("llama3_fsdp2_tp2_bf16", 4, "FSDP2 x TP2, bf16 parameters in compute, fp32 reduce"),
]
