"""Which forwards compile_blocks compiles (tracing is lazy: nothing is compiled here until a
forward runs). Numerics of compiled runs against eager ones: the features entries
llama3_fsdp2_compile_ac, llama3_pp2_fsdp2_compile and llama3_fsdp2_tp2_compile."""

import torch

from recipes import qwen3
from recipes.tests import features
from titan_lightning.parallel.compile import compile_blocks


def _model(run):
    with torch.device("meta"):
        return run.module.build_model()


def test_whole_blocks_without_tp():
    model = _model(features.llama3_debugmodel())
    assert compile_blocks(model.layers.values(), backend="aot_eager") == 6
    assert all(getattr(b, "compiled", None) == "aot_eager" for b in model.layers.values())
    assert not hasattr(model.layers["0"].attention, "compiled")


def test_children_under_tp_and_moe_stays_eager():
    model = _model(features.llama3_debugmodel())
    assert compile_blocks(model.layers.values(), backend="aot_eager", per_child=True) == 6 * 4
    block = model.layers["0"]
    assert not hasattr(block, "compiled")
    assert all(getattr(getattr(block, n), "compiled", None) for n in ("attention_norm", "attention", "ffn_norm", "feed_forward"))
    moe = _model(qwen3.debugmodel_moe())
    compile_blocks(moe.layers.values(), backend="aot_eager")
    block = moe.layers["0"]
    assert not hasattr(block, "compiled") and not hasattr(block.moe, "compiled")
    assert block.attention.compiled == "aot_eager"
