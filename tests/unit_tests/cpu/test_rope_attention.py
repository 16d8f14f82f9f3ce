import math

import pytest
import torch

from titan_lightning.models.common import Attention, RopeScaling, apply_rope, precompute_rope_cache, rope_frequencies


def llama31_scaled(freqs: list[float], factor: float, low: float, high: float, old_context: int) -> list[float]:
    """Meta's apply_scaling (llama-models, Llama 3.1), element by element."""
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def rotate_pairs(x: torch.Tensor, freqs: list[float]) -> torch.Tensor:
    """x [B, S, H, D]: rotate (x[2i], x[2i+1]) at position p by the angle p * freqs[i], in float64."""
    x, out = x.double(), torch.empty_like(x, dtype=torch.float64)
    for p in range(x.shape[1]):
        for i, f in enumerate(freqs):
            c, s = math.cos(p * f), math.sin(p * f)
            a, b = x[:, p, :, 2 * i], x[:, p, :, 2 * i + 1]
            out[:, p, :, 2 * i], out[:, p, :, 2 * i + 1] = a * c - b * s, a * s + b * c
    return out


def test_unscaled_frequencies_are_theta_to_the_minus_2i_over_d():
    expected = [500000.0 ** (-2 * i / 64) for i in range(32)]
    torch.testing.assert_close(rope_frequencies(64, 500000.0), torch.tensor(expected), rtol=1e-6, atol=0)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama31_scaling_matches_the_published_piecewise_formula(factor):
    scaling = RopeScaling(factor=factor)
    base = [500000.0 ** (-2 * i / 128) for i in range(64)]
    wavelens = [2 * math.pi / f for f in base]
    # head_dim 128, theta 500000 covers all three bands: kept, interpolated, stretched.
    assert min(wavelens) < 8192 / 4 and any(2048 <= w <= 8192 for w in wavelens) and max(wavelens) > 8192
    expected = llama31_scaled(base, factor, 1.0, 4.0, 8192)
    torch.testing.assert_close(rope_frequencies(128, 500000.0, scaling), torch.tensor(expected), rtol=1e-5, atol=0)


@pytest.mark.parametrize("theta, scaling", [(10000.0, None), (500000.0, RopeScaling(factor=8.0))])
def test_rope_rotates_pairs_by_position_times_frequency(theta, scaling):
    head_dim, seq_len = 16, 40
    freqs = [theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    if scaling is not None:
        freqs = llama31_scaled(freqs, scaling.factor, 1.0, 4.0, 8192)
    x = torch.randn(2, seq_len, 3, head_dim)
    cache = precompute_rope_cache(head_dim, 64, theta, scaling)  # longer than the sequence: apply_rope slices it
    torch.testing.assert_close(apply_rope(x, cache).double(), rotate_pairs(x, freqs), rtol=0, atol=1e-5)


def test_rope_keeps_the_input_dtype():
    x = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    assert apply_rope(x, precompute_rope_cache(8, 4, 10000.0)).dtype == torch.bfloat16


def naive_attention(attn: Attention, x: torch.Tensor, freqs: list[float]) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v, each query head reading key/value head h // n_rep."""
    B, S, _ = x.shape
    d = attn.head_dim
    q = rotate_pairs((x @ attn.wq.weight.T).view(B, S, -1, d), freqs).float()
    k = rotate_pairs((x @ attn.wk.weight.T).view(B, S, -1, d), freqs).float()
    v = (x @ attn.wv.weight.T).view(B, S, -1, d)
    n_heads, n_kv_heads = q.shape[2], k.shape[2]
    heads = []
    for h in range(n_heads):
        kv = h // (n_heads // n_kv_heads)
        scores = q[:, :, h] @ k[:, :, kv].transpose(-1, -2) / math.sqrt(d)  # [B, S, S]
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, :, kv])
    return torch.stack(heads, dim=2).reshape(B, S, -1) @ attn.wo.weight.T


@pytest.mark.parametrize("n_kv_heads", [8, 2, 1])
def test_attention_matches_naive_causal_softmax_with_repeated_kv_heads(n_kv_heads):
    torch.manual_seed(0)
    attn = Attention(dim=64, n_heads=8, n_kv_heads=n_kv_heads)
    x = torch.randn(2, 12, 64)
    theta = 10000.0
    freqs = [theta ** (-2 * i / 8) for i in range(4)]
    with torch.no_grad():
        out = attn(x, precompute_rope_cache(8, 12, theta))
        torch.testing.assert_close(out, naive_attention(attn, x, freqs), rtol=0, atol=1e-5)
