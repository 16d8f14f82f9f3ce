"""Rotary position embedding (RoPE) with Llama 3.1 frequency scaling.

The layout is Meta's and torchtitan's: a head's features are rotated in adjacent pairs
(x[2i], x[2i+1]) by the angle pos * freq_i. Hugging Face checkpoints rotate the two halves
of the head instead; their state-dict adapter permutes the wq/wk rows to convert.

The table is real-valued, (cos, sin) in float32, because ``Module.to(bfloat16)`` would
drop the imaginary part of a complex buffer.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(kw_only=True)
class RopeScaling:
    """Llama 3.1 long-context frequency scaling.

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
    stretched ``factor`` times, those shorter than ``... / high_freq_factor`` are kept, and
    the band in between is interpolated. Llama 3.1 uses factor 8, Llama 3.2 factor 32.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"model.rope_scaling.factor={self.factor!r} must be > 0")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"model.rope_scaling.low_freq_factor={self.low_freq_factor!r} must be > 0 and < "
                f"model.rope_scaling.high_freq_factor={self.high_freq_factor!r}"
            )
        n = self.original_max_position_embeddings
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"model.rope_scaling.original_max_position_embeddings={n!r} must be a positive integer")


def rope_frequencies(head_dim: int, theta: float, scaling: Optional[RopeScaling] = None) -> torch.Tensor:
    """Angular frequency of each feature pair, [head_dim // 2] float32."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    if scaling is None:
        return freqs
    s, n = scaling, scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / freqs
    smooth = (n / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    interpolated = (1 - smooth) * freqs / s.factor + smooth * freqs
    scaled = torch.where(wavelen > n / s.low_freq_factor, freqs / s.factor, interpolated)
    return torch.where(wavelen < n / s.high_freq_factor, freqs, scaled)


def precompute_rope_cache(
    head_dim: int, max_seq_len: int, theta: float, scaling: Optional[RopeScaling] = None
) -> torch.Tensor:
    """(cos, sin) of pos * freq_i for every position: [max_seq_len, head_dim // 2, 2] float32."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rope_frequencies(head_dim, theta, scaling))
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, head_dim] by positions 0..S-1 of ``cache``, computing in float32; a
    [B, S, head_dim // 2, 2] ``cache`` gives each token its own position (per-document RoPE)."""
    if cache.dim() == 4:
        cos, sin = cache[:, : x.shape[1], None].unbind(-1)  # [B, S, 1, head_dim // 2]
        x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)
    cos, sin = cache[: x.shape[1], None].unbind(-1)  # [S, 1, head_dim // 2]
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # [B, S, H, head_dim // 2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)
