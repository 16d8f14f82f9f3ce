"""Qwen 3 (dense and MoE): shapes and parameter counts of the presets, QK-norm, training
through the Trainer, and Hugging Face checkpoints through the state-dict adapter."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from recipes.qwen3 import debugmodel, debugmodel_moe
from titan_lightning.config import LRScheduleConfig, TrainingConfig
from titan_lightning.models.common.hf_checkpoint import INDEX_FILE, load_hf_safetensors, save_hf_safetensors
from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.qwen3 import (
    QWEN3_PRESETS,
    Qwen3Args,
    Qwen3StateDictAdapter,
    Transformer,
    qwen3_args,
)
from titan_lightning.models.qwen3.parallelize import TP_PLAN
from titan_lightning.parallel.tensor import _match
from titan_lightning.testing.record import RecordSteps
from titan_lightning.trainer import RUN_DIR_ENV, build_trainer

from tests.decoders import materialized, meta_model

# The model cards' "Number of Parameters" (total, non-embedding; MoE also activated), rounded
# as published. 0.6B, 1.7B and 4B tie lm_head to the embeddings there; we never tie, so our
# total is the card's plus vocab_size * dim.
PUBLISHED = {
    "0.6B": dict(total=0.6e9, non_embedding=0.44e9),
    "1.7B": dict(total=1.7e9, non_embedding=1.4e9),
    "4B": dict(total=4.0e9, non_embedding=3.6e9),
    "8B": dict(total=8.2e9, non_embedding=6.95e9),
    "14B": dict(total=14.8e9, non_embedding=13.2e9),
    "32B": dict(total=32.8e9, non_embedding=31.2e9),
    "30B-A3B": dict(total=30.5e9, non_embedding=29.9e9, active=3.3e9),
    "235B-A22B": dict(total=235e9, non_embedding=234e9, active=22e9),
}
TIED_ON_HF = ("0.6B", "1.7B", "4B")


@pytest.fixture(autouse=True)
def run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))


def small(moe: bool = False, **fields) -> Qwen3Args:
    """A two-layer debug model with head_dim != dim / n_heads: quick enough to run many times."""
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=96, vocab_size=128,
                max_seq_len=64)
    if moe:
        base["moe"] = MoEArgs(num_experts=8, top_k=2, hidden_dim=32, score_func="softmax", route_norm=True)
    return Qwen3Args(**{**base, **fields})


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights with O(1) logits and norm weights that are not all ones, so layout mistakes show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


# -- presets ---------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_parameter_count_matches_the_model_card(flavor):
    args = qwen3_args(flavor)
    published = PUBLISHED[flavor]
    total = sum(p.numel() for p in meta_model(args).parameters())
    assert total == Transformer.count_parameters(args)
    embedding = args.vocab_size * args.dim
    card_total = total - embedding if flavor in TIED_ON_HF else total
    for count, key in ((card_total, "total"), (total - 2 * embedding, "non_embedding"),
                       (Transformer.count_parameters(args, active=True), "active")):
        if key in published:  # the cards round to 2-3 significant digits
            assert count == pytest.approx(published[key], rel=0.02), key


def test_published_shapes():
    for flavor in PUBLISHED:
        args = qwen3_args(flavor)
        assert (args.vocab_size, args.head_dim, args.rope_theta, args.norm_eps) == (151936, 128, 1e6, 1e-6)
        assert args.qk_norm and args.n_heads > args.n_kv_heads
    for flavor in ("30B-A3B", "235B-A22B"):
        moe = qwen3_args(flavor).moe
        assert (moe.num_experts, moe.top_k, moe.num_shared_experts) == (128, 8, 0)
        assert moe.score_func == "softmax" and moe.route_norm and moe.load_balance_coeff == 1e-3
    assert qwen3_args("0.6B").moe is None


def test_debug_models():
    dense, moe = qwen3_args("debugmodel"), qwen3_args("debugmodel_moe")
    assert (dense.dim, dense.n_heads, dense.vocab_size, dense.moe) == (256, 16, 2048, None)
    assert dense.head_dim != dense.dim // dense.n_heads
    assert (moe.moe.num_experts, moe.moe.top_k) == (64, 8)
    assert Qwen3Args() == QWEN3_PRESETS["debugmodel"]


def test_qwen3_args_returns_a_fresh_copy():
    args = qwen3_args("30B-A3B")
    args.moe.top_k = 1
    assert QWEN3_PRESETS["30B-A3B"].moe.top_k == 8


def test_unknown_flavor_names_it_and_the_valid_ones():
    with pytest.raises(ValueError, match=r"'nope'.*debugmodel, debugmodel_moe, 0\.6B, .*235B-A22B"):
        qwen3_args("nope")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(head_dim=0), r"model\.head_dim=0 must be a positive integer"),
        (dict(head_dim=33), r"model\.head_dim=33 must be even"),
        (dict(ffn_hidden_dim=-1), r"model\.ffn_hidden_dim=-1 must be a positive integer"),
        (dict(norm_eps=0.0), r"model\.norm_eps=0\.0 must be > 0"),
        (dict(rope_theta=-1.0), r"model\.rope_theta=-1\.0 must be > 0"),
        (dict(n_heads=12, n_kv_heads=8), r"model\.n_heads=12 must be a multiple of model\.n_kv_heads=8"),
    ],
)
def test_args_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Qwen3Args(**kwargs)


def test_args_validation_reaches_the_moe_section():
    args = small(moe=True)
    args.moe.top_k = 9
    with pytest.raises(ValueError, match=r"moe\.top_k=9 must be <= moe\.num_experts=8"):
        args.__post_init__()


# -- the model -------------------------------------------------------------------------


def test_module_names_dense_and_moe():
    block = {"attention_norm.weight", "ffn_norm.weight", "attention.q_norm.weight", "attention.k_norm.weight"}
    block |= {f"attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
    dense = {f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
    moe = {"moe.router.gate.weight", "moe.experts.w1", "moe.experts.w2", "moe.experts.w3"}
    top = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for args, ffn in ((qwen3_args("debugmodel"), dense), (qwen3_args("debugmodel_moe"), moe)):
        names = {n for n, _ in meta_model(args).named_parameters()}
        assert names == top | {f"layers.{i}.{n}" for i in range(args.n_layers) for n in block | ffn}
    model = meta_model(qwen3_args("debugmodel_moe"))
    assert model.layers["0"].feed_forward is None
    assert model.layers["0"].moe.experts.w1.shape == (64, 64, 256)  # [E, hidden, dim]
    assert "layers.0.moe.expert_bias" in model.state_dict() and "rope_cache" not in model.state_dict()


def test_qk_norm_on_and_off():
    on, off = materialized(small()), materialized(small(qk_norm=False))
    assert on.layers["0"].attention.q_norm.weight.shape == (32,)  # one [head_dim] weight for all heads
    assert off.layers["0"].attention.q_norm is None and off.layers["0"].attention.k_norm is None
    assert Transformer.count_parameters(small()) - Transformer.count_parameters(small(qk_norm=False)) == 2 * 2 * 32
    assert sum(p.numel() for p in off.parameters()) == Transformer.count_parameters(small(qk_norm=False))
    # The norm really runs: scaling q_norm's weight changes the logits.
    tokens = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        before = on(tokens)
        on.layers["0"].attention.q_norm.weight.mul_(3.0)
        assert not torch.allclose(on(tokens), before, atol=1e-4)


def test_qk_norm_makes_attention_invariant_to_the_scale_of_wq_and_wk():
    model = randomized(materialized(small()))
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        before = model(tokens)
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(7.0)
            layer.attention.wk.weight.mul_(3.0)
        torch.testing.assert_close(model(tokens), before, rtol=1e-4, atol=1e-4)
    off = randomized(materialized(small(qk_norm=False)))
    with torch.no_grad():
        before = off(tokens)
        off.layers["0"].attention.wq.weight.mul_(7.0)
        assert not torch.allclose(off(tokens), before, atol=1e-2)


@pytest.mark.parametrize("moe", [False, True])
def test_forward_is_causal_with_logits_in_param_dtype(moe):
    model = materialized(small(moe))
    tokens = torch.randint(0, 128, (1, 24))
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % 128
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert before.shape == (1, 24, 128) and before.dtype == torch.float32
    torch.testing.assert_close(after[:, :10], before[:, :10], rtol=0, atol=1e-6)


def test_init_is_deterministic_covers_moe_and_zeroes_the_buffers():
    args = small(moe=True)
    a, b = materialized(args, seed=3), materialized(args, seed=3)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    moe = a.layers["1"].moe
    assert moe.experts.w1.std().item() == pytest.approx(0.02, rel=0.1)
    assert moe.experts.w2.std().item() == pytest.approx(0.02 / 4**0.5, rel=0.1)  # depth init, layer 1
    assert torch.equal(moe.expert_bias, torch.zeros(8)) and torch.equal(moe.tokens_per_expert, torch.zeros(8))
    assert torch.equal(a.layers["0"].attention.k_norm.weight, torch.ones(32))


def test_tp_plan_names_modules_of_both_kinds():
    """Every pattern finds modules (or the None slot a MoE or dense block leaves); routed experts stay out."""
    for flavor in ("debugmodel", "debugmodel_moe"):
        model = meta_model(qwen3_args(flavor))
        for pattern in TP_PLAN:
            found, removed = _match(model, pattern)
            assert found or removed, (flavor, pattern)
    assert TP_PLAN["layers.*.moe"] == "moe"
    assert not any(".moe.experts" in pattern for pattern in TP_PLAN)  # expert parallel, not TP


# -- training through the Trainer ----------------------------------------------------------


def fit(run, max_steps):
    record = RecordSteps()
    run.trainer.update(max_steps=max_steps, callbacks=[record], accelerator="cpu", devices=1, logger=False,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                       num_sanity_val_steps=0, limit_val_batches=0)
    build_trainer(run).fit(run.module, datamodule=run.datamodule)
    return record


def quick(recipe):
    """The debug recipe on 2 sequences of 64 tokens a step, deterministic, with a learning rate
    that does not depend on the number of steps (no decay)."""
    run = recipe()
    run.job.training = TrainingConfig(seq_len=64, tokens_per_microbatch_per_dp_rank=128, deterministic=True)
    run.job.lr_schedule = LRScheduleConfig(warmup_steps=1, decay_ratio=0.0)
    return run


# The MoE model (8 layers of 64 experts, 9 steps) is ~10 s: out of the inner loop (CONTRIBUTING).
@pytest.mark.parametrize("recipe", [debugmodel, pytest.param(debugmodel_moe, marks=pytest.mark.slow)])
def test_debug_model_trains_with_falling_loss_and_bitwise_identical_reruns(recipe):
    first, rerun = fit(quick(recipe), max_steps=6), fit(quick(recipe), max_steps=3)
    assert rerun.losses == first.losses[:3] and rerun.grad_norms == first.grad_norms[:3]
    assert first.losses[0] == pytest.approx(math.log(2048), abs=1.0)
    assert sum(first.losses[3:]) / 3 < first.losses[0] - 0.5  # batches differ: compare a mean


# -- Hugging Face checkpoints --------------------------------------------------------------


def hf_reference_logits(hf: dict[str, torch.Tensor], args: Qwen3Args, tokens: torch.Tensor) -> torch.Tensor:
    """Qwen3 / Qwen3-MoE as Hugging Face computes it, from Hugging Face weights: rotate-half RoPE,
    QK-norm per head, softmax top-k routing renormalized over the k. Written from the
    architecture, independently of our model, so it checks the adapter's layout changes."""
    def rms(x, w):
        return F.rms_norm(x, (x.shape[-1],), eps=args.norm_eps) * w

    B, S = tokens.shape
    hd, half = args.head_dim, args.head_dim // 2
    freqs = 1.0 / args.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
    angles = torch.outer(torch.arange(S).float(), freqs)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [S, hd]

    def rope(x):  # [B, H, S, hd]
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    h = hf["model.embed_tokens.weight"][tokens]
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        x = rms(h, hf[p + "input_layernorm.weight"])
        q = (x @ hf[p + "self_attn.q_proj.weight"].T).view(B, S, -1, hd)
        k = (x @ hf[p + "self_attn.k_proj.weight"].T).view(B, S, -1, hd)
        v = (x @ hf[p + "self_attn.v_proj.weight"].T).view(B, S, -1, hd).transpose(1, 2)
        q = rope(rms(q, hf[p + "self_attn.q_norm.weight"]).transpose(1, 2))
        k = rope(rms(k, hf[p + "self_attn.k_norm.weight"]).transpose(1, 2))
        rep = args.n_heads // args.n_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q @ k.transpose(-1, -2)) / hd**0.5
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, -1)
        h = h + y @ hf[p + "self_attn.o_proj.weight"].T
        x = rms(h, hf[p + "post_attention_layernorm.weight"])

        def mlp(x, m):
            gate, up, down = (hf[f"{m}{proj}_proj.weight"] for proj in ("gate", "up", "down"))
            return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T

        if args.moe is None:
            h = h + mlp(x, p + "mlp.")
        else:
            weights, experts = (x @ hf[p + "mlp.gate.weight"].T).softmax(-1).topk(args.moe.top_k, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            for e in range(args.moe.num_experts):
                gate = (weights * (experts == e)).sum(-1, keepdim=True)
                out = out + gate * mlp(x, f"{p}mlp.experts.{e}.")
            h = h + out
    return rms(h, hf["model.norm.weight"]) @ hf["lm_head.weight"].T


@pytest.mark.parametrize("moe", [False, True])
def test_adapter_gives_hugging_face_logits(moe):
    args = small(moe)
    model = randomized(materialized(args), seed=1)
    hf = Qwen3StateDictAdapter(args).to_hf(model.state_dict())
    tokens = torch.randint(0, args.vocab_size, (2, 20))
    with torch.no_grad():
        ours, reference = model(tokens), hf_reference_logits(hf, args, tokens)
    assert reference.std() > 0.5
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("moe", [False, True])
def test_adapter_round_trip_is_the_identity(moe):
    args = small(moe)
    adapter = Qwen3StateDictAdapter(args)
    sd = randomized(materialized(args)).state_dict()
    hf = adapter.to_hf(sd)
    assert "lm_head.weight" in hf and "model.layers.1.self_attn.q_norm.weight" in hf
    if moe:
        assert hf["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)  # [dim, hidden]
        assert torch.equal(hf["model.layers.1.mlp.experts.7.down_proj.weight"], sd["layers.1.moe.experts.w2"][7])
        assert not any("expert_bias" in k for k in hf)
    back = adapter.from_hf(hf)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    again = adapter.to_hf(back)
    assert again.keys() == hf.keys() and all(torch.equal(again[k], hf[k]) for k in hf)


def test_q_and_k_rows_are_permuted_per_head_from_pairs_to_halves():
    args = small(qk_norm=True)
    sd = materialized(args).state_dict()
    wq = torch.arange(args.n_heads * args.head_dim, dtype=torch.float32)[:, None].expand(-1, args.dim)
    sd["layers.0.attention.wq.weight"] = wq
    hf = Qwen3StateDictAdapter(args).to_hf(sd)["model.layers.0.self_attn.q_proj.weight"][:, 0]
    head1 = hf[args.head_dim : 2 * args.head_dim] - args.head_dim
    # HF head feature c * head_dim/2 + i is our feature 2i + c.
    assert head1.tolist() == list(range(0, 32, 2)) + list(range(1, 32, 2))


@pytest.mark.parametrize("moe", [False, True])
def test_save_and_load_through_sharded_safetensors(tmp_path, moe):
    args = small(moe)
    adapter = Qwen3StateDictAdapter(args)
    model = randomized(materialized(args))
    adapter.save_from(model, tmp_path, max_shard_bytes=40_000)
    shards = sorted(p.name for p in tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / INDEX_FILE).is_file()
    assert not (tmp_path / "model.safetensors").exists()
    loaded = materialized(args, seed=5)
    adapter.load_into(loaded, tmp_path)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    # A second, smaller save replaces the shards and the index by one file.
    adapter.save_from(model, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert load_hf_safetensors(tmp_path).keys() == adapter.to_hf(model.state_dict()).keys()


def test_tied_hugging_face_checkpoint_loads_into_the_untied_output(tmp_path):
    args = small()
    model = randomized(materialized(args))
    with torch.no_grad():
        model.output.weight.copy_(model.tok_embeddings.weight)
    tied = Qwen3StateDictAdapter(args, tie_word_embeddings=True)
    tied.save_from(model, tmp_path)
    assert "lm_head.weight" not in load_hf_safetensors(tmp_path)
    loaded = materialized(args, seed=2)
    tied.load_into(loaded, tmp_path)
    assert torch.equal(loaded.output.weight, model.tok_embeddings.weight)
    with torch.no_grad():
        loaded.output.weight.add_(1.0)
    with pytest.raises(ValueError, match="output.weight differs from tok_embeddings.weight"):
        tied.to_hf(loaded.state_dict())


def test_loading_names_missing_and_unexpected_keys(tmp_path):
    args = small()
    adapter = Qwen3StateDictAdapter(args)
    hf = adapter.to_hf(materialized(args).state_dict())
    del hf["model.layers.1.self_attn.k_norm.weight"]
    save_hf_safetensors(hf, tmp_path)
    missing = ("missing keys [model.layers.1.self_attn.k_norm.weight (ours layers.1.attention.k_norm.weight)]; "
               "unexpected keys []")
    with pytest.raises(ValueError, match=re.escape(missing)):
        adapter.load_into(materialized(args), tmp_path)
    adapter.save_from(materialized(args), tmp_path)  # complete again
    unexpected = "missing keys []; unexpected keys [model.layers.0.self_attn.k_norm.weight (ours layers.0.attention"
    with pytest.raises(ValueError, match=re.escape(unexpected)):
        adapter.load_into(materialized(small(qk_norm=False)), tmp_path)
    shape = ("model.layers.0.self_attn.q_proj.weight (ours layers.0.attention.wq.weight) has shape (128, 64), "
             "the model has (64, 64)")
    with pytest.raises(ValueError, match=re.escape(shape)):
        adapter.load_into(materialized(small(n_heads=2, n_kv_heads=2)), tmp_path)
    hf["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"no Qwen3 name for Hugging Face keys model\.layers\.0\.mlp\.shared_expert"):
        adapter.from_hf(hf)


def test_missing_expert_is_named():
    args = small(moe=True)
    adapter = Qwen3StateDictAdapter(args)
    hf = adapter.to_hf(materialized(args).state_dict())
    del hf["model.layers.0.mlp.experts.3.up_proj.weight"]
    missing = ("model.layers.0.mlp.experts.*.up_proj.weight (ours layers.0.moe.experts.w3): expected experts 0..7 "
               "(model.moe.num_experts=8), missing [3]")
    with pytest.raises(ValueError, match=re.escape(missing)):
        adapter.from_hf(hf)


def test_wrong_shapes_name_the_hugging_face_key_and_ours():
    args = small(moe=True)
    adapter = Qwen3StateDictAdapter(args)
    hf = adapter.to_hf(materialized(args).state_dict())
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    wrong = ("q_proj shape [120, 64] for model.layers.0.self_attn.q_proj.weight (ours layers.0.attention.wq.weight) "
             "expected [128, 64]")
    with pytest.raises(ValueError, match=re.escape(wrong)):
        adapter.from_hf({**hf, q_proj: hf[q_proj][:120]})
    up_proj = "model.layers.1.mlp.experts.5.up_proj.weight"
    wrong = ("up_proj shape [32, 63] for model.layers.1.mlp.experts.5.up_proj.weight (ours layers.1.moe.experts.w3[5]) "
             "expected [32, 64]")
    with pytest.raises(ValueError, match=re.escape(wrong)):
        adapter.from_hf({**hf, up_proj: hf[up_proj][:, :63]})


def test_missing_or_truncated_checkpoint_files_fail_naming_the_file(tmp_path):
    tensors = {f"t{i}": torch.randn(64, 64) for i in range(4)}
    save_hf_safetensors(tensors, tmp_path, max_shard_bytes=20_000)
    assert torch.equal(load_hf_safetensors(tmp_path)["t3"], tensors["t3"])
    second = tmp_path / "model-00002-of-00004.safetensors"
    data = second.read_bytes()
    second.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model-00002-of-00004\.safetensors: not a readable safetensors file"):
        load_hf_safetensors(tmp_path)
    second.unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00004\.safetensors: checkpoint file is missing"):
        load_hf_safetensors(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_hf_safetensors(tmp_path / "empty")
