"""Sliding-window attention on the GPU kernels (models/common/masking.py): FlexAttention's block
mask with a window and varlen FlashAttention's ``window_size``, with and without document
masking, against attention written out (outputs and q/k/v gradients).

In fp64 flex must equal the reference to 1e-10 (the CPU tests check its forward only: torch has
no FlexAttention backward there); in bf16 each kernel's error must stay within 4x that of bf16
SDPA with the dense mask (the rule of test_document_masking_gpu.py). Model level: a bf16 Llama
with alternating sliding and full layers on each kernel against the fp64 sdpa model.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from titan_lightning.models.common.decoder import decoder_class
from titan_lightning.models.common.masking import attend, documents_for

sys.path.insert(0, str(Path(__file__).parents[1] / "cpu"))
from test_document_masking import FAMILIES, VOCAB  # noqa: E402

pytestmark = pytest.mark.gpu

LENGTHS = [[37, 1, 190, 1, 273, 9, 1], [512], [255, 257]]
S = 512
WINDOWS = [37, 128]  # not a multiple of the 128-token blocks, and one


def _positions(lengths, device="cuda"):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(device)


class _Args:
    def __init__(self, kernel, mask, window):
        self.mask, self.positions, self.attention, self.max_seq_len = mask, "global", kernel, S
        self.sliding_window, self.layer_types = window, None


def _allowed(mask, window):
    """[B, 1, S, S]: j <= i, i - window < j, and (block_causal) the same document, written out."""
    ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in LENGTHS], device="cuda")
    if mask == "causal":
        ids = torch.zeros_like(ids)
    i, j = torch.arange(S, device="cuda")[:, None], torch.arange(S, device="cuda")[None, :]
    return ((j <= i) & (j > i - window) & (ids[:, :, None] == ids[:, None, :]))[:, None]


def _inputs(dtype, heads=8, kv_heads=2, dim=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(len(LENGTHS), S, h, dim, generator=g, device="cuda", dtype=dtype, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)]


def _grads(out, inputs, weight):
    return [out, *torch.autograd.grad((out.double() * weight).sum(), inputs)]


def _sdpa(q, k, v, weight, allowed):
    rep = q.shape[2] // k.shape[2]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
                                         v.repeat_interleave(rep, 2).transpose(1, 2), attn_mask=allowed)
    return _grads(out.transpose(1, 2), [q, k, v], weight)


def _kernel(kernel, mask, window, q, k, v, weight):
    docs = documents_for(_Args(kernel, mask, window), _positions(LENGTHS), q)
    return _grads(attend(q, k, v, docs, window=window), [q, k, v], weight)


def _errors(results, reference):
    return [(a.double() - b.double()).abs().max().item() for a, b in zip(results, reference)]


@pytest.mark.parametrize("mask", ["causal", "block_causal"])
@pytest.mark.parametrize("window", WINDOWS)
def test_flex_sliding_equals_the_reference_in_fp64(mask, window):
    q, k, v = _inputs(torch.float64)
    weight = torch.randn_like(q)
    reference = _sdpa(q, k, v, weight, _allowed(mask, window))
    for name, error in zip(("out", "dq", "dk", "dv"), _errors(_kernel("flex", mask, window, q, k, v, weight),
                                                              reference)):
        assert error < 1e-10, f"flex {name} differs by {error:.2e}"


@pytest.mark.parametrize("kernel", ["flex", "varlen"])
@pytest.mark.parametrize("mask", ["causal", "block_causal"])
@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_kernel_in_bf16_is_as_close_as_masked_sdpa(kernel, mask, window):
    exact = _inputs(torch.float64)
    weight = torch.randn_like(exact[0])
    allowed = _allowed(mask, window)
    reference = _sdpa(*exact, weight, allowed)
    low = [t.detach().bfloat16().requires_grad_() for t in exact]
    baseline = _errors(_sdpa(*low, weight.bfloat16(), allowed), reference)
    errors = _errors(_kernel(kernel, mask, window, *low, weight.bfloat16()), reference)
    scale = reference[0].abs().max().item()
    print(f"\n{kernel} {mask} window {window} bf16 max errors (out, dq, dk, dv): {errors}; SDPA: {baseline}")
    for name, error, base in zip(("out", "dq", "dk", "dv"), errors, baseline):
        assert error <= 4 * base + 1e-3 * scale, f"{kernel} {name}: {error:.2e} > 4 x {base:.2e}"


@pytest.mark.parametrize("kernel", ["flex", "varlen"])
def test_a_bf16_model_with_alternating_windows_is_as_close_as_bf16_sdpa(kernel):
    lengths = [[5, 1, 9, 1, 12, 4], [32]]
    args = dataclasses.replace(FAMILIES["llama3"], dim=256, n_layers=2, mask="block_causal",
                               positions="per_document", sliding_window=6,
                               layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    sdpa = decoder_class(type(args))(args).cuda()
    sdpa.init_weights(seed=0)
    model = decoder_class(type(args))(dataclasses.replace(args, attention=kernel)).cuda()
    model.load_state_dict(sdpa.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1)).cuda()
    positions = _positions(lengths)
    reference = sdpa.double()(tokens, positions)
    base = (sdpa.bfloat16()(tokens, positions).double() - reference).abs().max().item()
    error = (model.bfloat16()(tokens, positions).double() - reference).abs().max().item()
    print(f"\n{kernel} bf16 logits error {error:.3e}; bf16 SDPA {base:.3e}")
    assert error <= 4 * base + 1e-3 * reference.abs().max().item()
