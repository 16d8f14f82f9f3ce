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


def _moe_model(**moe):
    import dataclasses

    run = qwen3.debugmodel_moe()
    run.job.model = dataclasses.replace(run.job.model, moe=dataclasses.replace(run.job.model.moe, **moe))
    return run, _model(run)


def test_moe_stays_eager_says_why_where_the_token_path_reads_the_host():
    from titan_lightning.models.common.moe import CPU_GROUPED_MM
    from titan_lightning.parallel.compile import moe_stays_eager

    _, looped = _moe_model(use_grouped_mm=False)
    assert "per-expert loop on cpu" in moe_stays_eager(looped, device_type="cpu", dtype=torch.bfloat16, tp=False,
                                                       ep_dispatch=None)
    assert "bf16 only" in moe_stays_eager(looped, device_type="cpu", dtype=torch.float32, tp=False, ep_dispatch=None)
    _, default = _moe_model(use_grouped_mm=None)  # the automatic choice: the grouped GEMM on Hopper GPUs only
    assert "per-expert loop" in moe_stays_eager(default, device_type="cpu", dtype=torch.bfloat16, tp=False,
                                                ep_dispatch=None)
    assert "tensor parallelism" in moe_stays_eager(default, device_type="cpu", dtype=torch.bfloat16, tp=True,
                                                   ep_dispatch=None)
    assert "'splits' dispatch" in moe_stays_eager(default, device_type="cpu", dtype=torch.bfloat16, tp=False,
                                                  ep_dispatch="splits")
    if not CPU_GROUPED_MM:
        # The static token path is torch._grouped_mm's; torch releases before its CPU kernel only have
        # the per-expert loop on CPU (CI's 2.13 has it; this runs there), so there is nothing to test.
        pytest.skip("this torch has no grouped GEMM on CPU: no static token path to check here")
    _, grouped = _moe_model(use_grouped_mm=True)
    for dispatch in (None, "padded"):
        assert moe_stays_eager(grouped, device_type="cpu", dtype=torch.bfloat16, tp=False, ep_dispatch=dispatch) is None
    assert "FSDP unit of their own" in moe_stays_eager(grouped, device_type="cpu", dtype=torch.bfloat16, tp=False,
                                                       ep_dispatch="padded", experts_sharded_apart=True)


def _parallelize_one_rank(rank, world_size, use_grouped_mm):
    from titan_lightning.config.parallelism import ParallelismConfig
    from titan_lightning.parallel.mesh import ParallelDims
    from titan_lightning.parallel.parallelize import parallelize

    run, model = _moe_model(use_grouped_mm=use_grouped_mm)
    job = run.job
    job.compile.enable, job.compile.backend = True, "aot_eager"
    job.training.mixed_precision_param = "bfloat16"
    assert "moe" in job.compile.components
    mesh = ParallelDims.from_config(ParallelismConfig(), world_size).build_mesh("cpu")
    applied = parallelize(model, mesh, job, fsdp=False, ddp=False)
    block = model.layers["0"]
    return getattr(block, "compiled", None), getattr(block.attention, "compiled", None), applied.notes


def test_parallelize_compiles_moe_blocks_whole_by_default_where_the_token_path_is_static():
    """compile.components' default has 'moe': a one-process layout on the grouped GEMM compiles the
    MoE blocks whole; on the per-expert loop they keep their MoE layer eager and the notes say why."""
    from titan_lightning.models.common.moe import CPU_GROUPED_MM
    from titan_lightning.testing.threaded import run_threaded

    if not CPU_GROUPED_MM:
        # The static token path is torch._grouped_mm's; torch releases before its CPU kernel only have
        # the per-expert loop on CPU (CI's 2.13 has it; this runs there), so there is nothing to test.
        pytest.skip("this torch has no grouped GEMM on CPU: no static token path to compile whole")
    [(block, attention, notes)] = run_threaded(_parallelize_one_rank, 1, use_grouped_mm=True)
    assert (block, attention, notes) == ("aot_eager", None, [])
    [(block, attention, notes)] = run_threaded(_parallelize_one_rank, 1, use_grouped_mm=False)
    assert (block, attention) == (None, "aot_eager")
    assert len(notes) == 1 and notes[0].startswith("compile: MoE layers stay eager: the experts take the per-expert loop")
