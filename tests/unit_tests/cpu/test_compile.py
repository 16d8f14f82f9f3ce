"""Which forwards compile_blocks compiles (tracing is lazy: nothing is compiled here until a
forward runs). Numerics of compiled runs against eager ones: the features entries
llama3_fsdp2_compile_ac, llama3_pp2_fsdp2_compile and llama3_fsdp2_tp2_compile."""

import pytest
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


def test_moe_blocks_compile_whole_with_the_moe_component_and_match_eager():
    """compile.components 'moe': a block with an MoE layer is compiled whole; on the grouped GEMM
    path (no host read of the token counts; bf16, the dtype torch's grouped GEMM takes when
    traced) it gives the eager block's output."""
    import dataclasses

    from titan_lightning.models.common.decoder import decoder_class

    run = qwen3.debugmodel_moe()
    args = run.job.model
    args = dataclasses.replace(args, n_layers=1, moe=dataclasses.replace(args.moe, use_grouped_mm=True))
    torch.manual_seed(0)
    eager = decoder_class(type(args))(args)
    eager.init_weights(seed=0)
    eager.bfloat16()
    compiled = decoder_class(type(args))(args).bfloat16()
    compiled.load_state_dict(eager.state_dict())
    assert compile_blocks(compiled.layers.values(), backend="aot_eager", moe=True) == 1
    assert compiled.layers["0"].compiled == "aot_eager"
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(compiled(tokens), eager(tokens), rtol=0, atol=0)


def test_a_compiled_moe_block_under_checkpointing_is_one_graph(monkeypatch):
    """The MoE's token counting (a buffer update in its forward) inside per-op checkpointing: dynamo
    refuses the side effect (the checkpointed block would run eagerly) until compile_blocks with
    the 'moe' component lets the recompute skip it; then the block is one graph, counting once."""
    import dataclasses

    from titan_lightning.models.common.decoder import decoder_class
    from titan_lightning.parallel.activation_checkpoint import apply_activation_checkpointing

    monkeypatch.setattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint", False)
    run = qwen3.debugmodel_moe()
    args = run.job.model
    args = dataclasses.replace(args, n_layers=1, moe=dataclasses.replace(args.moe, use_grouped_mm=True,
                                                                         token_group_align=8))
    model = decoder_class(type(args))(args)
    model.init_weights(seed=0)
    model.bfloat16()
    blocks = list(model.layers.values())
    apply_activation_checkpointing(blocks, "selective", "op")
    checkpointed = blocks[0].forward
    x = torch.randn(2, 16, args.dim, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(Exception, match="side effect"):
        torch.compile(checkpointed, backend="aot_eager", fullgraph=True)(x, model.rope_cache)
    torch._dynamo.reset()
    compile_blocks(blocks, backend="aot_eager", moe=True)
    torch.compile(checkpointed, backend="aot_eager", fullgraph=True)(x, model.rope_cache).float().sum().backward()
    assert blocks[0].moe.tokens_per_expert.sum().item() == 2 * 16 * args.moe.top_k  # counted once
