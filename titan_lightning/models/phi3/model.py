"""Phi-3 and Phi-4 decoders, with torchtitan's submodule names.

Llama's block (pre-norm grouped-query attention, RoPE, SwiGLU). Hugging Face fuses the q, k and v
projections (``qkv_proj``) and the SwiGLU's gate and up (``gate_up_proj``); we hold them apart
(wq / wk / wv, w1 / w3), so the tensor-parallel plan shards whole heads and the adapter splits and
fuses (models/phi3/state_dict_adapter.py). What Phi adds to RoPE:

- ``rotary_dim`` (``partial_rotary_factor``, Phi-4-mini 0.75): RoPE turns the first ``rotary_dim``
  features of each head and passes the rest through; in the table the other pairs turn by angle 0.
- ``rope_scaling`` (LongRoPE, ``longrope`` / ``su``: the 128k models): each frequency divided by its
  own factor, cos and sin multiplied by ``attention_factor``. transformers picks the short factors
  while the sequence fits ``original_max_position_embeddings`` and the long ones past it, by the
  length of the batch; ours are fixed for a run (``factors``) and the family's check holds them to
  transformers' choice for ``training.seq_len`` (models/phi3/state_dict_adapter.py).
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch

from titan_lightning.models.common.args import DecoderArgs
from titan_lightning.models.common.decoder import Decoder
from titan_lightning.models.phi3.parallelize import TP_PLAN


@dataclass(kw_only=True)
class LongRope:
    """LongRoPE frequency scaling (Hugging Face ``rope_type: longrope``)."""

    # One factor per rotated feature pair (rotary_dim // 2 of each).
    short_factor: list[float]
    long_factor: list[float]
    original_max_position_embeddings: int = 4096
    # cos and sin are multiplied by it (transformers: sqrt(1 + ln(factor) / ln(original)) by default).
    attention_factor: float = 1.0
    # The set this run's table uses: "short" (sequences up to original_max_position_embeddings) or "long".
    factors: str = "short"

    def __post_init__(self) -> None:
        if self.factors not in ("short", "long"):
            raise ValueError(f"model.rope_scaling.factors={self.factors!r} must be 'short' or 'long'")
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(f"model.rope_scaling: short_factor has {len(self.short_factor)} factors, long_factor "
                             f"{len(self.long_factor)}; one per rotated feature pair each")
        n = self.original_max_position_embeddings
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"model.rope_scaling.original_max_position_embeddings={n!r} must be a positive integer")
        if not self.attention_factor > 0:
            raise ValueError(f"model.rope_scaling.attention_factor={self.attention_factor!r} must be > 0")


def longrope_attention_factor(max_position_embeddings: int, original: int, factor: Optional[float] = None) -> float:
    """transformers' default ``attention_factor``: 1 up to the original length, else
    sqrt(1 + ln(factor) / ln(original)), ``factor`` max_position_embeddings / original unless given."""
    factor = max_position_embeddings / original if factor is None else factor
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


@dataclass(kw_only=True)
class Phi3Args(DecoderArgs):
    """Phi-3 / Phi-4 architecture. The defaults are the debugmodel's shape with RoPE on every feature;
    presets.py has the debugmodel and the published sizes."""

    # Features of each head RoPE turns (the first ones); None: all of them.
    rotary_dim: Optional[int] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[LongRope] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rotary_dim is not None:
            self.require_positive_ints("rotary_dim", minimum=2)
        if self.rotated % 2 or self.rotated > self.head_dim:
            raise ValueError(f"model.rotary_dim={self.rotary_dim} must be even and at most "
                             f"model.head_dim={self.head_dim}")
        if self.rope_scaling is not None:
            self.rope_scaling.__post_init__()
            if len(self.rope_scaling.short_factor) != self.rotated // 2:
                raise ValueError(f"model.rope_scaling has {len(self.rope_scaling.short_factor)} factors; RoPE turns "
                                 f"{self.rotated // 2} feature pairs of each head")

    @property
    def rotated(self) -> int:
        """The features of each head RoPE turns."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim


def phi3_rope_cache(args: Phi3Args) -> torch.Tensor:
    """(cos, sin) for every position, [max_seq_len, head_dim // 2, 2] float32, as transformers computes
    them (the same float32 expressions): the ``rotated // 2`` turned pairs first, then pairs at angle 0."""
    rotated, scaling = args.rotated, args.rope_scaling
    exponents = torch.arange(0, rotated, 2, dtype=torch.int64).float() / rotated
    if scaling is None:
        freqs, mscale = 1.0 / (args.rope_theta ** exponents), 1.0
    else:
        factors = scaling.long_factor if scaling.factors == "long" else scaling.short_factor
        freqs = 1.0 / (torch.tensor(factors, dtype=torch.float32) * args.rope_theta ** exponents)
        mscale = scaling.attention_factor
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)
    turned = torch.stack((angles.cos() * mscale, angles.sin() * mscale), dim=-1)
    still = torch.tensor([1.0, 0.0]).expand(args.max_seq_len, (args.head_dim - rotated) // 2, 2)
    return torch.cat((turned, still), dim=1)


class Transformer(Decoder):
    """Phi-3 / Phi-4: token embeddings, pre-norm GQA blocks with SwiGLU, final norm, untied output
    (models/common/decoder.py has the skeleton)."""

    args_class, plan = Phi3Args, TP_PLAN

    def build_rope_cache(self) -> torch.Tensor:
        return phi3_rope_cache(self.args)
