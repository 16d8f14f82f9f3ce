"""Document-masked attention kernels on a GPU (models/common/masking.py): FlexAttention and
varlen FlashAttention against running each document on its own.

Attention level: a packed batch of documents of random lengths (including length 1 and one
filling a row), outputs and gradients of q, k, v. In fp64 flex must equal the reference to
1e-10 (torch has no FlexAttention backward on CPU: the CPU tests check its forward only); in
bf16 each kernel's error must stay within 4x that of unsharded bf16 SDPA run per document (as
the context-parallel GPU tests bound theirs). Model level: a bf16 packed model of each family
(GQA, MLA with its narrower value heads) against fp64 document-by-document runs, the same rule.
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
from test_document_masking import _documents as _spans  # noqa: E402

pytestmark = pytest.mark.gpu

LENGTHS = [[37, 1, 190, 1, 273, 9, 1], [512], [255, 257]]
S = 512


def _positions(lengths, device="cuda"):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(device)


class _Args:
    def __init__(self, kernel):
        self.mask, self.positions, self.attention, self.max_seq_len = "block_causal", "global", kernel, S


def _inputs(dtype, heads=8, kv_heads=2, dim=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = lambda h: (len(LENGTHS), S, h, dim)  # noqa: E731
    return [torch.randn(shape(h), generator=g, device="cuda", dtype=dtype, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)]


def _grads(out, inputs, weight):
    return [out, *torch.autograd.grad((out.double() * weight).sum(), inputs)]


def _per_document(q, k, v, weight):
    """Each document alone through causal SDPA (GQA by repetition), stitched back together."""
    rep = q.shape[2] // k.shape[2]
    out = torch.zeros_like(q)
    for b, start, n in _spans(LENGTHS):
        piece = lambda t: t[b:b + 1, start:start + n].transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(piece(q), piece(k).repeat_interleave(rep, 1),
                                           piece(v).repeat_interleave(rep, 1), is_causal=True)
        out[b:b + 1, start:start + n] = y.transpose(1, 2)
    return _grads(out, [q, k, v], weight)


def _kernel(kernel, q, k, v, weight):
    docs = documents_for(_Args(kernel), _positions(LENGTHS), q)
    return _grads(attend(q, k, v, docs), [q, k, v], weight)


def _errors(results, reference):
    return [(a.double() - b.double()).abs().max().item() for a, b in zip(results, reference)]


def test_flex_equals_each_document_alone_in_fp64():
    q, k, v = _inputs(torch.float64)
    weight = torch.randn_like(q)
    reference = _per_document(q, k, v, weight)
    for name, error in zip(("out", "dq", "dk", "dv"), _errors(_kernel("flex", q, k, v, weight), reference)):
        assert error < 1e-10, f"flex {name} differs by {error:.2e}"


@pytest.mark.parametrize("kernel", ["flex", "varlen"])
def test_kernel_in_bf16_is_as_close_as_per_document_sdpa(kernel):
    exact = _inputs(torch.float64)
    weight = torch.randn_like(exact[0])
    reference = _per_document(*exact, weight)
    low = [t.detach().bfloat16().requires_grad_() for t in exact]
    baseline = _errors(_per_document(*low, weight.bfloat16()), reference)
    errors = _errors(_kernel(kernel, *low, weight.bfloat16()), reference)
    scale = reference[0].abs().max().item()
    print(f"\n{kernel} bf16 max errors (out, dq, dk, dv): {errors}; per-document SDPA: {baseline}")
    for name, error, base in zip(("out", "dq", "dk", "dv"), errors, baseline):
        assert error <= 4 * base + 1e-3 * scale, f"{kernel} {name}: {error:.2e} > 4 x {base:.2e}"


# Head dims the GPU kernels take (the CPU test models' are 8 and 12): 64; MLA's value heads 32.
WIDER = {"llama3": dict(dim=256), "deepseek_v3": dict(dim=256, kv_lora_rank=64, qk_nope_head_dim=32,
                                                      qk_rope_head_dim=32, v_head_dim=32)}


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
@pytest.mark.parametrize("kernel", ["flex", "varlen"])
def test_a_bf16_packed_model_is_as_close_to_its_documents_as_bf16_sdpa(family, kernel):
    lengths = [[5, 1, 9, 1, 12, 4], [32]]
    args = dataclasses.replace(FAMILIES[family], **WIDER[family])
    torch.manual_seed(0)
    packed = decoder_class(type(args))(dataclasses.replace(args, mask="block_causal", positions="per_document",
                                                           attention=kernel)).cuda()
    packed.init_weights(seed=0)
    alone = decoder_class(type(args))(args).cuda()  # causal, global positions, sdpa
    alone.load_state_dict(packed.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1)).cuda()
    positions = _positions(lengths)

    def by_document(model):
        rows = [[model(tokens[b:b + 1, s:s + n]) for row, s, n in _spans(lengths) if row == b] for b in range(2)]
        return torch.cat([torch.cat(pieces, dim=1) for pieces in rows]).double()

    reference = by_document(alone.double())
    alone.bfloat16()
    packed.bfloat16()
    base = (by_document(alone) - reference).abs().max().item()
    error = (packed(tokens, positions).double() - reference).abs().max().item()
    print(f"\n{family} {kernel} bf16 logits error {error:.3e}; per-document bf16 SDPA {base:.3e}")
    assert error <= 4 * base + 1e-3 * reference.abs().max().item()
