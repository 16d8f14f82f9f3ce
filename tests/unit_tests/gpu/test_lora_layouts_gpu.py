"""The routed experts' adapters on a GPU: bf16 through torch._grouped_mm against the fp32 per-expert loop."""

import pytest
import torch
from torch import nn

from titan_lightning.config.lora import LoRAConfig
from titan_lightning.lora.experts import add_expert_adapters
from titan_lightning.models.common.moe import GroupedExperts, grouped_mm_available

pytestmark = pytest.mark.gpu


def _experts(use_grouped_mm: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.experts = GroupedExperts(dim=256, hidden_dim=512, num_experts=8, use_grouped_mm=use_grouped_mm)
    for w in (model.experts.w1, model.experts.w2, model.experts.w3):
        nn.init.normal_(w, std=0.05)
        w.requires_grad_(False)
    add_expert_adapters(model, LoRAConfig(rank=16, alpha=32.0, target_parameters="gate_up_proj,down_proj"))
    for factor in (*model.experts.lora_a.values(), *model.experts.lora_b.values()):
        nn.init.normal_(factor, std=0.05)
    return model.cuda()


def test_expert_adapters_on_the_grouped_gemm_in_bf16_equal_the_fp32_loop():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm needs compute capability 9.0 or newer")
    counts = torch.tensor([5, 0, 17, 3, 0, 40, 1, 6], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    grouped, loop = _experts(True), _experts(False)
    assert grouped_mm_available(x.bfloat16())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = grouped.experts(x, counts)
    assert out.dtype == torch.bfloat16
    want = loop.experts(x, counts)  # fp32: the loop
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    out.float().square().sum().backward()
    want.square().sum().backward()
    for name in ("gate_up_proj", "down_proj"):
        for factors in ("lora_a", "lora_b"):
            got, reference = (getattr(m.experts, factors)[name].grad for m in (grouped, loop))
            assert torch.isfinite(got).all() and got.abs().sum() > 0
            assert (got - reference).norm() / reference.norm() < 3e-2, f"{factors}[{name}]"
