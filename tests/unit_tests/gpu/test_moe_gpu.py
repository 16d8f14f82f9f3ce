"""Grouped experts on a GPU: torch._grouped_mm against the exact per-expert loop."""

import pytest
import torch

from titan_lightning.models.common.moe import GroupedExperts, _looped_swiglu, grouped_mm_available

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("counts", [[5, 0, 17, 3, 0, 40, 1, 6], [16] * 8, [0] * 7 + [64]])
def test_grouped_mm_equals_the_per_expert_loop_in_bf16(counts):
    if torch.cuda.get_device_capability()[0] < 9:
        # Older GPUs have no grouped GEMM kernel: GroupedExperts takes the loop there, which the
        # CPU tests (test_moe.py) already check against a per-token reference.
        pytest.skip("torch._grouped_mm needs compute capability 9.0 or newer")
    torch.manual_seed(0)
    experts = GroupedExperts(dim=256, hidden_dim=512, num_experts=8).cuda()
    with torch.no_grad():
        for w in (experts.w1, experts.w2, experts.w3):
            w.normal_(std=0.05)
    counts = torch.tensor(counts, device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert grouped_mm_available(x)
    out = experts(x, counts)
    out.float().square().sum().backward()
    grads = [experts.w1.grad.clone(), x.grad.clone()]
    experts.zero_grad()
    x.grad = None
    w1, w2, w3 = experts.weights(torch.bfloat16)
    loop = _looped_swiglu(x, counts, w1, w2, w3)
    loop.float().square().sum().backward()
    scale = loop.float().abs().max().item()
    assert (out.float() - loop.float()).abs().max().item() <= 2e-2 * scale
    for grouped, looped in zip(grads, [experts.w1.grad, x.grad]):
        assert (grouped.float() - looped.float()).abs().max().item() <= 3e-2 * looped.float().abs().max().item()


def _bf16_moe(**fields):
    from titan_lightning.models.common.moe import MoE, MoEArgs

    torch.manual_seed(0)
    args = MoEArgs(num_experts=16, top_k=4, hidden_dim=512, num_shared_experts=1, score_func="sigmoid",
                   route_norm=True, num_groups=4, top_k_groups=2, **fields)
    moe = MoE(256, args).cuda()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.05)
    moe.reset_buffers()
    return moe


def _step(moe):
    x = torch.randn(4, 256, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1), requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = moe(x)
    out.float().square().sum().backward()
    return [out, x.grad] + [p.grad for p in moe.parameters()]


def test_the_moe_layer_never_waits_for_the_host_in_deterministic_mode():
    """Forward and backward under set_sync_debug_mode("error") (forbid_host_sync sets it) with
    deterministic algorithms on: no host read, and no op that deterministic mode refuses."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm needs compute capability 9.0 or newer")
    from titan_lightning.testing.host_sync import forbid_host_sync

    moe = _bf16_moe()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        x = torch.randn(4, 256, 256, device="cuda", requires_grad=True)
        with forbid_host_sync(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = moe(x)
            out.float().square().sum().backward()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert moe.experts.w1.grad is not None


def test_padding_changes_no_bit_on_the_gpu():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm needs compute capability 9.0 or newer")
    results = {align: _step(_bf16_moe(token_group_align=align)) for align in (1, 8, 16, 128)}
    for align, tensors in results.items():
        assert all(torch.equal(a, b) for a, b in zip(results[1], tensors)), f"align {align} changed a result"
