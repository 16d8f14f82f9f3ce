"""gpt-oss's attention sinks on a GPU (models/common/masking.py): FlexAttention's sinks (its
output scaled by sigmoid(lse - sink), the log-sum-exp it returns) against sdpa's (one more key
whose score is the sink), values and gradients of q, k, v and the sinks. In fp64 (flex's eager path) to
1e-10; in bf16 (flex compiled) within 4x the error of bf16 sdpa, both against fp64 sdpa. The
CPU tests (tests/unit_tests/cpu/test_attention_sinks.py) check flex's forward only: torch has no
FlexAttention backward on CPU."""

import pytest
import torch

from titan_lightning.models.common.masking import attend, documents_for

pytestmark = pytest.mark.gpu

S, H, KV, D = 512, 8, 2, 64
LENGTHS = [[37, 1, 190, 284], [512]]


class _Args:
    def __init__(self, kernel, mask, window):
        self.attention, self.mask, self.positions, self.max_seq_len = kernel, mask, "global", S
        self.sliding_window, self.layer_types = window, None


def _positions():
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS]).cuda()


def _inputs(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(2, S, h, D, generator=g, device="cuda", dtype=torch.float64) for h in (H, KV, KV)]
    tensors.append(torch.randn(H, generator=g, device="cuda", dtype=torch.float64) * 2)
    return [t.to(dtype).requires_grad_() for t in tensors]


def _run(kernel, mask, window, q, k, v, sinks, weight):
    out = attend(q, k, v, documents_for(_Args(kernel, mask, window), _positions(), q), window=window, sinks=sinks)
    return [out, *torch.autograd.grad((out * weight).sum(), (q, k, v, sinks))]


def _errors(results, reference):
    return [(a.double() - b.double()).abs().max().item() for a, b in zip(results, reference)]


@pytest.mark.parametrize("mask", ["causal", "block_causal"])
@pytest.mark.parametrize("window", [None, 128])
def test_flex_sinks_equal_sdpa_sinks_in_fp64(mask, window):
    inputs = _inputs(torch.float64)
    weight = torch.randn_like(inputs[0])
    reference = _run("sdpa", mask, window, *inputs, weight)
    for name, error in zip(("out", "dq", "dk", "dv", "dsinks"), _errors(_run("flex", mask, window, *inputs, weight),
                                                                        reference)):
        assert error < 1e-10, f"flex {name} differs by {error:.2e}"


@pytest.mark.parametrize("mask", ["causal", "block_causal"])
@pytest.mark.parametrize("window", [None, 128])
def test_flex_sinks_in_bf16_are_as_close_as_sdpa_sinks(mask, window):
    exact = _inputs(torch.float64)
    weight = torch.randn_like(exact[0])
    reference = _run("sdpa", mask, window, *exact, weight)
    low = [t.detach().bfloat16().requires_grad_() for t in exact]
    baseline = _errors(_run("sdpa", mask, window, *low, weight.bfloat16()), reference)
    errors = _errors(_run("flex", mask, window, *low, weight.bfloat16()), reference)
    for name, error, base, ref in zip(("out", "dq", "dk", "dv", "dsinks"), errors, baseline, reference):
        assert error <= 4 * base + 1e-3 * ref.abs().max().item(), f"flex {name}: {error:.2e} > 4 x {base:.2e}"
