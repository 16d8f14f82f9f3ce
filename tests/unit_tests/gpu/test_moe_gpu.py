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
