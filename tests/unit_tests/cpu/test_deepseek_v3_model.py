"""DeepSeek V3: sizes, MLA, YaRN, init, training on the Trainer path, HF names, CP."""

import math
from fnmatch import fnmatchcase

import pytest
import torch
import torch.distributed as dist

from titan_lightning.models.deepseek_v3 import (
    DEEPSEEK_V3_PRESETS,
    DeepSeekV3Args,
    MultiHeadLatentAttention,
    Transformer,
    deepseek_v3_args,
    deepseek_v3_tp_plan,
    yarn_rope_cache,
)
from titan_lightning.parallel.context import ContextParallel
from titan_lightning.testing.record import RecordSteps
from titan_lightning.trainer import RUN_DIR_ENV, build_trainer

from tests.decoders import assert_causal, materialized, meta_model

# DeepSeek's published totals (without the 671B's multi-token-prediction layer) and active
# parameters per token: DeepSeek-V3 671B / 37B, DeepSeek-V2-Lite (our 16B) 15.7B / 2.4B.
PUBLISHED = {"16B": (15.7e9, 2.4e9), "671B": (671e9, 37e9)}


def random_attention(args: DeepSeekV3Args, dtype=torch.float32) -> MultiHeadLatentAttention:
    attention = MultiHeadLatentAttention(args).to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.2)
    return attention


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_parameter_counts_match_published(flavor):
    args = deepseek_v3_args(flavor)
    total, active = PUBLISHED[flavor]
    assert sum(p.numel() for p in meta_model(args).parameters()) == Transformer.count_parameters(args)
    assert Transformer.count_parameters(args) == pytest.approx(total, rel=0.005)
    assert Transformer.count_parameters(args, active=True) == pytest.approx(active, rel=0.025)


def test_671b_has_the_published_shapes():
    a = deepseek_v3_args("671B")
    assert (a.n_layers, a.n_dense_layers, a.vocab_size, a.n_heads) == (61, 3, 129280, 128)
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (1536, 512, 128,
                                                                                                      64, 128)
    m = a.moe
    assert (m.num_experts, m.top_k, m.num_shared_experts, m.score_func, m.route_norm, m.route_scale) == (
        256, 8, 1, "sigmoid", True, 2.5)


def test_debugmodel_parameter_count_is_arithmetic():
    args = deepseek_v3_args("debugmodel")
    assert Transformer.count_parameters(args) == sum(p.numel() for p in Transformer(args).parameters()) == 14_161_536


def test_module_names_follow_torchtitan():
    model = meta_model(DeepSeekV3Args(n_layers=2, q_lora_rank=32))
    names = {n for n, _ in model.named_parameters()}
    attention = {f"attention.{n}.weight" for n in ("wq_a", "q_norm", "wq_b", "wkv_a", "kv_norm", "wkv_b", "wo")}
    common = attention | {"attention_norm.weight", "ffn_norm.weight"}
    dense = {f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
    moe = {"moe.router.gate.weight", "moe.experts.w1", "moe.experts.w2", "moe.experts.w3"}
    moe |= {f"moe.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")}
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    expected |= {f"layers.0.{n}" for n in common | dense} | {f"layers.1.{n}" for n in common | moe}
    assert names == expected
    state = model.state_dict()
    assert "layers.1.moe.expert_bias" in state and "rope_cache" not in state
    assert model.layers["0"].moe is None and model.layers["1"].feed_forward is None


@pytest.mark.parametrize("q_lora_rank", [0, 32])
def test_mla_shapes(q_lora_rank):
    args = DeepSeekV3Args(q_lora_rank=q_lora_rank)
    attention = random_attention(args)
    h, qk = args.n_heads, args.qk_head_dim
    assert attention.wkv_a.weight.shape == (args.kv_lora_rank + args.qk_rope_head_dim, args.dim)
    assert attention.wkv_b.weight.shape == (h * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank)
    assert attention.wo.weight.shape == (args.dim, h * args.v_head_dim)
    query = attention.wq_b if q_lora_rank else attention.wq
    assert query.weight.shape == (h * qk, q_lora_rank or args.dim)
    out = attention(torch.randn(2, 24, args.dim), yarn_rope_cache(args))
    assert out.shape == (2, 24, args.dim)


def test_mla_is_causal():
    args = DeepSeekV3Args(q_lora_rank=32)
    attention = random_attention(args)
    x = torch.randn(1, 24, args.dim)
    changed = x.clone()
    changed[0, 10] += 1.0
    cache = yarn_rope_cache(args)
    with torch.no_grad():
        before, after = attention(x, cache), attention(changed, cache)
    assert torch.equal(after[:, :10], before[:, :10])
    assert (after[:, 10:] - before[:, 10:]).abs().amax(-1).min() > 1e-4


def test_model_is_causal_through_the_moe_layers():
    args = DeepSeekV3Args(n_layers=2)
    assert_causal(materialized(args, seed=0), args.vocab_size)


def test_yarn_slows_only_the_low_frequencies_and_corrects_the_softmax_scale():
    plain = DeepSeekV3Args(max_seq_len=4096, original_seq_len=4096)
    yarn = DeepSeekV3Args(max_seq_len=8192, original_seq_len=4096, rope_factor=40.0, mscale=0.7)
    assert not plain.uses_yarn and plain.softmax_scale == plain.qk_head_dim**-0.5
    assert yarn.softmax_scale == pytest.approx(yarn.qk_head_dim**-0.5 * (0.1 * 0.7 * math.log(40.0) + 1) ** 2)
    # Angle of position 1 per feature pair = the frequency.
    f_plain = torch.atan2(yarn_rope_cache(plain)[1, :, 1], yarn_rope_cache(plain)[1, :, 0])
    f_yarn = torch.atan2(yarn_rope_cache(yarn)[1, :, 1], yarn_rope_cache(yarn)[1, :, 0])
    assert f_yarn[0] == f_plain[0]  # the fastest pair turns > beta_fast times: kept
    assert f_yarn[-1] == pytest.approx(f_plain[-1] / 40.0, rel=1e-5)  # the slowest: stretched 40 times
    assert (f_yarn <= f_plain).all()


def test_init_is_deterministic_and_covers_every_parameter():
    args = DeepSeekV3Args(n_layers=2)
    a, b = materialized(args, seed=3), materialized(args, seed=3)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    moe = a.layers["1"].moe
    assert torch.equal(moe.expert_bias, torch.zeros(8)) and torch.equal(moe.tokens_per_expert, torch.zeros(8))
    assert a.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert moe.experts.w2.std().item() == pytest.approx(0.02 / 4**0.5, rel=0.05)  # depth init, layer 1
    assert torch.equal(a.layers["0"].attention.kv_norm.weight, torch.ones(args.kv_lora_rank))


def test_tp_plan_names_modules_of_the_model():
    for q_lora_rank in (0, 32):
        args = DeepSeekV3Args(q_lora_rank=q_lora_rank)
        names = [n for n, _ in meta_model(args).named_modules()]
        for pattern in deepseek_v3_tp_plan(args):
            assert any(fnmatchcase(n, pattern) for n in names), pattern
        plan = deepseek_v3_tp_plan(args)
        assert plan["layers.*.moe"] == "moe" and plan["layers.*.moe.shared_experts.*"] == "moe_replicated"
        assert not any(".moe.experts" in p for p in plan)  # routed experts: expert parallel, not TP


# -- training through the Trainer ----------------------------------------------------------


@pytest.fixture
def run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))


def _fit_debugmodel(steps: int) -> RecordSteps:
    from recipes.deepseek_v3 import debugmodel

    run = debugmodel()
    t = run.job.training
    t.seq_len, t.tokens_per_microbatch_per_dp_rank, t.deterministic = 128, 256, True
    run.job.lr_schedule.warmup_steps = 1
    record = RecordSteps()
    run.trainer.update(
        max_steps=steps, callbacks=[record], accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    build_trainer(run).fit(run.module, datamodule=run.datamodule)
    return record


def test_debugmodel_trains_on_cpu_and_reruns_bitwise(run_folder):
    first, second = _fit_debugmodel(4), _fit_debugmodel(4)
    assert first.losses == second.losses and first.grad_norms == second.grad_norms
    assert first.losses[0] == pytest.approx(math.log(2048), abs=1.5)
    assert first.losses[-1] < first.losses[0] - 0.2


# -- Hugging Face names ----------------------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank", [0, 32])
def test_adapter_round_trip_is_the_identity(q_lora_rank, tmp_path):
    from titan_lightning.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    args = DeepSeekV3Args(n_layers=3, q_lora_rank=q_lora_rank, vocab_size=256)
    model = materialized(args, seed=0)
    model.layers["1"].moe.expert_bias.normal_()
    state = model.state_dict()
    adapter = DeepSeekV3StateDictAdapter(args)
    hf = adapter.to_hf(state)
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in hf and "model.layers.0.mlp.gate_proj.weight" in hf
    assert torch.equal(hf["model.layers.1.mlp.experts.3.up_proj.weight"], state["layers.1.moe.experts.w3"][3])
    assert torch.equal(hf["model.layers.1.mlp.gate.e_score_correction_bias"], state["layers.1.moe.expert_bias"])
    back = adapter.from_hf(hf)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    adapter.save_from(model, tmp_path)  # and through the safetensors files
    loaded = materialized(args, seed=1)
    adapter.load_into(loaded, tmp_path)
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())


def test_adapter_reads_fused_experts_and_skips_layers_past_n_layers():
    from titan_lightning.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    args = DeepSeekV3Args(n_layers=2)
    state = materialized(args, seed=0).state_dict()
    adapter = DeepSeekV3StateDictAdapter(args)
    hf = {k: v for k, v in adapter.to_hf(state).items() if ".experts." not in k}
    e = state["layers.1.moe.experts.w1"].shape[0]
    hf["model.layers.1.mlp.experts.gate_up_proj"] = torch.cat(
        [state["layers.1.moe.experts.w1"], state["layers.1.moe.experts.w3"]], dim=1)
    hf["model.layers.1.mlp.experts.down_proj"] = state["layers.1.moe.experts.w2"]
    hf["model.layers.2.eh_proj.weight"] = torch.zeros(1)  # a multi-token-prediction layer
    back = adapter.from_hf(hf)
    assert all(torch.equal(back[k], state[k]) for k in state) and back.keys() == state.keys()
    del hf["model.layers.1.mlp.experts.down_proj"]
    hf.update({f"model.layers.1.mlp.experts.{j}.down_proj.weight": state["layers.1.moe.experts.w2"][j]
               for j in range(e - 1)})
    with pytest.raises(ValueError, match=r"experts\.\*\.down_proj\.weight \(ours layers\.1\.moe\.experts\.w2\): "
                                         r"expected experts 0\.\.7 .*missing \[7\]"):
        adapter.from_hf(hf)


# -- context parallelism ---------------------------------------------------------------------


def _mla_cp_errors(rank: int, world_size: int, *, backend: str) -> dict:
    """This rank's largest output and input-gradient error of MLA under CP against unsharded MLA."""
    args = DeepSeekV3Args(q_lora_rank=32, max_seq_len=64, original_seq_len=16)  # YaRN on: scale != default
    attention = random_attention(args, torch.float64)
    attention.backend = backend
    cache = yarn_rope_cache(args)
    g = torch.Generator().manual_seed(1)
    x, weight = (torch.randn(2, 32, args.dim, generator=g, dtype=torch.float64) for _ in range(2))
    full = x.clone().requires_grad_()
    reference = attention(full, cache)
    (reference * weight).sum().backward()
    attention.cp = cp = ContextParallel(group=dist.group.WORLD, rank=rank, size=world_size)
    local = cp.shard(x).requires_grad_()
    out = attention(local, cache)
    (out * cp.shard(weight)).sum().backward()
    return {"out": (out - cp.shard(reference)).abs().max().item(),
            "dx": (local.grad - cp.shard(full.grad)).abs().max().item()}


@pytest.mark.parametrize("backend", ["allgather", "ring", "ulysses"])
def test_mla_under_cp_equals_unsharded_mla(backend):
    from titan_lightning.testing.threaded import run_threaded

    for errors in run_threaded(_mla_cp_errors, 2, backend=backend):
        assert errors["out"] < 1e-10 and errors["dx"] < 1e-10, errors


# -- configuration ---------------------------------------------------------------------------


def test_presets_are_fresh_copies_and_unknown_flavors_name_the_valid_ones():
    args = deepseek_v3_args("671B")
    args.moe.top_k = 1
    assert DEEPSEEK_V3_PRESETS["671B"].moe.top_k == 8
    assert DeepSeekV3Args() == DEEPSEEK_V3_PRESETS["debugmodel"]
    with pytest.raises(ValueError, match=r"'nope'.*debugmodel, 16B, 671B"):
        deepseek_v3_args("nope")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dim=0), r"model\.dim=0 must be a positive integer"),
        (dict(kv_lora_rank=0), r"model\.kv_lora_rank=0 must be a positive integer"),
        (dict(q_lora_rank=-1), r"model\.q_lora_rank=-1 must be an integer >= 0"),
        (dict(n_dense_layers=7), r"model\.n_dense_layers=7 must be <= model\.n_layers=6"),
        (dict(rope_factor=0.0), r"model\.rope_factor=0\.0 must be > 0"),
        (dict(latent_norm_eps=0.0), r"model\.latent_norm_eps=0\.0 must be > 0"),
        (dict(n_kv_heads=8), r"model\.n_kv_heads=8 must equal model\.n_heads=16"),
        (dict(qk_rope_head_dim=15), r"model\.qk_rope_head_dim=15 must be even"),
    ],
)
def test_args_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeepSeekV3Args(**kwargs)
