"""Llama 3 decoder, with the submodule names of torchtitan and Meta's reference."""

from dataclasses import dataclass, field
from typing import Optional

import torch

from titan_lightning.config.job import ModelArgs
from titan_lightning.models.common import RopeScaling, precompute_rope_cache
from titan_lightning.models.common.decoder import Decoder
from titan_lightning.models.llama3.parallelize import TP_PLAN


@dataclass(kw_only=True)
class Llama3Args(ModelArgs):
    """Llama 3 architecture. The defaults are the debugmodel; presets.py has the published sizes."""

    dim: int = 256
    n_layers: int = 6
    # The SwiGLU width is 8/3 * dim, times ffn_dim_multiplier, rounded up to multiple_of; or
    # ffn_dim when set (Hugging Face ``intermediate_size``).
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    ffn_dim: Optional[int] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # None: plain RoPE (Llama 3.0).
    rope_scaling: Optional[RopeScaling] = field(default_factory=RopeScaling)
    max_seq_len: int = 2048
    # std of wo/w2/w3: 0.02 / sqrt(2 * (layer_id + 1)) if True, else 0.02 / sqrt(2 * n_layers).
    depth_init: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_positive_ints("dim", "n_layers", "multiple_of", "max_seq_len")
        if self.ffn_dim is not None:
            self.require_positive_ints("ffn_dim")
        self.require_positive("norm_eps", "rope_theta", "ffn_dim_multiplier")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(
                f"model.dim={self.dim} / model.n_heads={self.n_heads} = {self.head_dim} must be even "
                f"(RoPE rotates pairs of features)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * -(-hidden // self.multiple_of)


class Transformer(Decoder):
    """Llama 3: token embeddings, pre-norm GQA/SwiGLU blocks, final norm, untied output
    (models/common/decoder.py has the skeleton)."""

    args_class, plan = Llama3Args, TP_PLAN

    def build_rope_cache(self) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    @classmethod
    def count_parameters(cls, args: Llama3Args, *, active: bool = False) -> int:
        """Embeddings and output are not tied; every parameter is active."""
        d, kv = args.dim, args.n_kv_heads * args.head_dim
        attention = 2 * d * d + 2 * d * kv
        feed_forward = 3 * d * args.ffn_hidden_dim
        return 2 * args.vocab_size * d + args.n_layers * (attention + feed_forward + 2 * d) + d
