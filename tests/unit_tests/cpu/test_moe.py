"""MoE building blocks: routing, grouped experts, combine order, load-balancing bias."""

import pytest
import torch
import torch.nn.functional as F

from titan_lightning.models.common.moe import MoE, MoEArgs, TokenChoiceTopKRouter, update_expert_bias


def _moe(**fields) -> MoE:
    args = MoEArgs(**{"num_experts": 8, "top_k": 3, "hidden_dim": 16, **fields})
    moe = MoE(32, args)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    moe.reset_buffers()
    return moe


def _per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its experts one at a time: the definition the batched code must equal."""
    tokens = x.reshape(-1, x.shape[-1])
    scores, experts, _ = moe.router(tokens, moe.expert_bias if moe.load_balance_coeff else None)
    w = moe.experts
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for slot in range(experts.shape[1]):
            e = experts[t, slot]
            h = (F.silu(tokens[t] @ w.w1[e].T) * (tokens[t] @ w.w3[e].T)) @ w.w2[e].T
            out[t] += scores[t, slot] * h
    if moe.shared_experts is not None:
        out += moe.shared_experts(tokens)
    return out.reshape(x.shape)


@pytest.mark.parametrize("fields", [dict(), dict(num_shared_experts=2), dict(score_func="sigmoid", route_norm=True,
                                    route_scale=2.5), dict(load_balance_coeff=None, top_k=1)])
def test_moe_equals_routing_each_token_through_its_experts(fields):
    moe = _moe(**fields)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(moe(x), _per_token_reference(moe, x), atol=1e-6)


def test_scores_before_or_after_the_experts_differ_only_for_nonlinear_experts():
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(2))
    after, before = _moe(), _moe(score_before_experts=True)
    with torch.no_grad():
        assert not torch.allclose(after(x), before(x))  # SwiGLU is not homogeneous: a real option
        # top_k=1 with scores exactly 1 (route_norm): both orders agree
        one_a, one_b = _moe(top_k=1, route_norm=True), _moe(top_k=1, route_norm=True, score_before_experts=True)
        assert torch.allclose(one_a(x), one_b(x), atol=1e-6)


def test_router_picks_the_top_k_scores_and_the_bias_only_changes_the_choice():
    router = TokenChoiceTopKRouter(4, num_experts=4, top_k=2)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4))
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    scores, experts, counts = router(x)
    assert experts.tolist() == [[0, 1], [3, 2]]
    probs = torch.softmax(x, dim=-1)
    assert torch.allclose(scores, probs.gather(1, experts))
    assert counts.tolist() == [1, 1, 1, 1]
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])  # expert 3 favoured
    biased_scores, biased, _ = router(x, bias)
    assert biased.tolist() == [[3, 0], [3, 2]]
    assert torch.allclose(biased_scores, probs.gather(1, biased))  # weights: unbiased scores
    again = router(x, bias)
    assert all(torch.equal(a, b) for a, b in zip(again, (biased_scores, biased, _)))  # deterministic


def test_counts_accumulate_in_training_forwards_only():
    moe = _moe()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        moe(x)
    assert moe.tokens_per_expert.sum() == 0
    moe(x).sum().backward()
    assert moe.tokens_per_expert.sum() == 2 * 5 * 3


def test_load_balancing_bias_moves_toward_balance_on_a_skewed_batch():
    moe = _moe(top_k=1, load_balance_coeff=0.05)
    with torch.no_grad():
        moe.router.gate.weight[0] += 0.3  # skew: expert 0 wins most tokens
    x = torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(3)).abs()

    def spread():
        counts = torch.bincount(moe.router(x.reshape(-1, 32), moe.expert_bias)[1].flatten(), minlength=8)
        return (counts.max() - counts.min()).item()

    start = spread()
    for _ in range(30):
        moe(x).sum().backward()
        update_expert_bias(moe)
    assert spread() < start / 2
    assert moe.tokens_per_expert.sum() == 0  # reset after each update
    assert abs(moe.expert_bias.sum().item()) < 1e-5  # centred


@pytest.mark.parametrize("fields, message", [
    (dict(top_k=9), r"moe.top_k=9 must be <= moe.num_experts=8"),
    (dict(score_func="relu"), r"moe.score_func='relu' is not one of softmax, sigmoid"),
    (dict(load_balance_coeff=0.0), r"moe.load_balance_coeff=0.0 must be > 0, or None"),
    (dict(num_experts=0), r"moe.num_experts=0 must be a positive integer"),
])
def test_bad_moe_args_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        MoEArgs(**{"num_experts": 8, "top_k": 2, **fields})


def test_experts_compute_in_the_autocast_dtype(monkeypatch):
    """Under bf16 autocast over fp32 weights the experts run in bf16 (the grouped GEMM's dtype on
    GPUs; fp32 inputs would fall back to the per-expert loop), with the same result as autocast
    applied to each expert's matmuls, and fp32 gradients for the fp32 weights."""
    import titan_lightning.models.common.moe as moe_module

    moe = _moe()
    x = torch.randn(2, 5, 32)
    seen = []
    chooser = moe_module.grouped_mm_available
    monkeypatch.setattr(moe_module, "grouped_mm_available", lambda t: seen.append(t.dtype) or chooser(t))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
        tokens = x.reshape(-1, 32)
        scores, experts, _ = moe.router(tokens, moe.expert_bias)
    assert seen == [torch.bfloat16]
    w = moe.experts
    reference = torch.zeros_like(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for t in range(tokens.shape[0]):
            for slot in range(experts.shape[1]):
                e = experts[t, slot]
                h = (F.silu(tokens[t:t + 1] @ w.w1[e].T) * (tokens[t:t + 1] @ w.w3[e].T)) @ w.w2[e].T
                reference[t] += scores[t, slot] * h[0].float()
    torch.testing.assert_close(out.float().reshape(-1, 32), reference, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert w.w1.grad is not None and w.w1.grad.dtype == torch.float32
