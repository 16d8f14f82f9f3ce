"""Group-limited routing (DeepSeek V3's n_group / topk_group): each token's experts come from its
best groups, a group scored by the sum of its 2 best biased scores; no groups routes as before."""

from typing import Optional

import pytest
import torch

from ep_cases import ep_matches_one_process
from titan_lightning.models.common.moe import MoE, MoEArgs, TokenChoiceTopKRouter
from titan_lightning.testing.threaded import run_threaded

DIM = 16


def router(seed: int = 0, **fields) -> TokenChoiceTopKRouter:
    args = MoEArgs(**{"num_experts": 16, "top_k": 3, "hidden_dim": 8, **fields})
    r = MoE(DIM, args).router
    with torch.no_grad():
        r.gate.weight.copy_(torch.randn(r.gate.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return r


def tokens(n: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))


def brute_force_experts(choice: list[float], num_groups: int, top_k_groups: int, top_k: int) -> set[int]:
    """One token's experts by the definition: rank the groups by the sum of their 2 best choice
    scores, keep the best top_k_groups, take the top_k experts among theirs."""
    size = len(choice) // num_groups
    groups = [list(range(g * size, (g + 1) * size)) for g in range(num_groups)]
    group_score = [sum(sorted((choice[e] for e in members), reverse=True)[:2]) for members in groups]
    best = sorted(range(num_groups), key=lambda g: group_score[g], reverse=True)[:top_k_groups]
    allowed = [e for g in best for e in groups[g]]
    return set(sorted(allowed, key=lambda e: choice[e], reverse=True)[:top_k])


@pytest.mark.parametrize("score_func, biased", [("sigmoid", True), ("sigmoid", False), ("softmax", True)])
def test_group_limited_choice_equals_the_brute_force_definition(score_func, biased):
    r = router(num_groups=4, top_k_groups=2, score_func=score_func)
    x = tokens()
    bias = 0.3 * torch.randn(16, generator=torch.Generator().manual_seed(2)) if biased else None
    weights, experts, counts = r(x, bias)
    scores = torch.softmax(r.gate(x), -1) if score_func == "softmax" else torch.sigmoid(r.gate(x))
    choice = scores if bias is None else scores + bias
    unlimited = torch.topk(choice, 3, dim=-1).indices
    differs = 0
    for t in range(x.shape[0]):
        expected = brute_force_experts(choice[t].tolist(), 4, 2, 3)
        assert set(experts[t].tolist()) == expected, f"token {t}"
        differs += set(unlimited[t].tolist()) != expected
    assert differs > 5  # the groups changed many tokens' experts: the limit is exercised
    torch.testing.assert_close(weights, scores.gather(-1, experts), rtol=0, atol=0)  # unbiased weights
    assert counts.tolist() == torch.bincount(experts.flatten(), minlength=16).tolist()


def reference_router(r: TokenChoiceTopKRouter, x: torch.Tensor, expert_bias: Optional[torch.Tensor]):
    """The router as it was before expert groups."""
    logits = r.gate(x).float()
    scores = torch.softmax(logits, dim=-1) if r.score_func == "softmax" else torch.sigmoid(logits)
    if expert_bias is None:
        top_scores, experts = torch.topk(scores, r.top_k, dim=-1)
    else:
        experts = torch.topk(scores + expert_bias, r.top_k, dim=-1).indices
        top_scores = scores.gather(-1, experts)
    if r.route_norm:
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
    return top_scores * r.route_scale, experts


@pytest.mark.parametrize("fields", [dict(), dict(score_func="sigmoid", route_norm=True, route_scale=2.5),
                                    dict(num_groups=4, top_k_groups=4)])  # every group kept: no limit
@pytest.mark.parametrize("biased", [False, True])
def test_without_a_group_limit_routing_is_bitwise_as_before(fields, biased):
    r = router(**fields)
    x = tokens().requires_grad_()
    bias = 0.3 * torch.randn(16, generator=torch.Generator().manual_seed(2)) if biased else None
    weights, experts, _ = r(x, bias)
    weights.pow(2).sum().backward()
    grad, x.grad = x.grad, None
    expected_weights, expected_experts = reference_router(r, x, bias)
    expected_weights.pow(2).sum().backward()
    assert torch.equal(experts, expected_experts)
    assert torch.equal(weights, expected_weights)
    assert torch.equal(grad, x.grad)


def test_group_limited_routing_is_deterministic_and_differentiable():
    r = router(num_groups=8, top_k_groups=3, top_k=4, score_func="sigmoid", route_norm=True)
    x = tokens().requires_grad_()
    runs = []
    for _ in range(2):
        weights, experts, _ = r(x, torch.zeros(16))
        (grad,) = torch.autograd.grad(weights.sin().sum(), x)
        runs.append((weights, experts, grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert runs[0][2].abs().sum() > 0


def test_ep_with_expert_groups_equals_the_unsharded_moe():
    for rank, errors in enumerate(run_threaded(ep_matches_one_process, 2, num_groups=4, top_k_groups=2)):
        for name in ("out", "dx", "gate", "w1"):
            assert errors[name] < 1e-12, f"rank {rank}: {name} differs by {errors[name]:.2e}"


@pytest.mark.parametrize("fields, message", [
    (dict(num_groups=0), r"moe\.num_groups=0 must be a positive integer"),
    (dict(top_k_groups=3, num_groups=2), r"moe\.top_k_groups=3 must be <= moe\.num_groups=2"),
    (dict(num_groups=3), r"moe\.num_groups=3 must divide moe\.num_experts=16"),
    (dict(num_groups=16, top_k_groups=8), r"moe\.num_groups=16 leaves 1 expert per group .* at most 8 groups, or 1"),
    (dict(num_groups=8, top_k_groups=1), r"moe\.top_k=3 must be <= moe\.top_k_groups=1 x 2 experts per group"),
])
def test_bad_group_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        MoEArgs(**{"num_experts": 16, "top_k": 3, **fields})
