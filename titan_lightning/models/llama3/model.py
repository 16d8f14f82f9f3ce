"""Llama 3 decoder, with the submodule names of torchtitan and Meta's reference."""

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from titan_lightning.config.job import ModelArgs
from titan_lightning.models.common import (
    Attention,
    FeedForward,
    RMSNorm,
    RopeScaling,
    init_params,
    precompute_rope_cache,
)


@dataclass(kw_only=True)
class Llama3Args(ModelArgs):
    """Llama 3 architecture. The defaults are the debugmodel; presets.py has the published sizes."""

    dim: int = 256
    n_layers: int = 6
    # The SwiGLU width is 8/3 * dim, times ffn_dim_multiplier, rounded up to multiple_of.
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # None: plain RoPE (Llama 3.0).
    rope_scaling: Optional[RopeScaling] = field(default_factory=RopeScaling)
    max_seq_len: int = 2048
    # std of wo/w2/w3: 0.02 / sqrt(2 * (layer_id + 1)) if True, else 0.02 / sqrt(2 * n_layers).
    depth_init: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("dim", "n_layers", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name}={value!r} must be a positive integer")
        for name in ("norm_eps", "rope_theta", "ffn_dim_multiplier"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"model.{name}={value!r} must be > 0")
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
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * -(-hidden // self.multiple_of)


def count_parameters(args: Llama3Args) -> int:
    """Parameters of ``Transformer(args)``, by arithmetic (embeddings and output are not tied)."""
    d, kv = args.dim, args.n_kv_heads * args.head_dim
    attention = 2 * d * d + 2 * d * kv
    feed_forward = 3 * d * args.ffn_hidden_dim
    return 2 * args.vocab_size * d + args.n_layers * (attention + feed_forward + 2 * d) + d


class TransformerBlock(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.attention)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama 3: token embeddings, pre-norm GQA/SwiGLU blocks, final norm, untied output.

    Build it on the meta device, shard it, then ``to_empty(device=...)`` and
    ``init_weights(seed)``. ``layers`` is a ModuleDict keyed "0", "1", ... so a pipeline
    stage can delete blocks and keep the names; a stage may also set ``tok_embeddings``,
    ``norm`` or ``output`` to None, and then takes or returns hidden states [B, S, dim].

    ``rope_cache`` is a non-persistent float32 buffer rebuilt by ``init_weights``; casting
    the whole model to bfloat16 afterwards would round it too.
    """

    def __init__(self, args: Llama3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def _rope_cache(self) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab_size], in the dtype of the parameters."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_weights(self, seed: int) -> None:
        """Draw every parameter from (seed, its name), as in torchtitan; rebuild ``rope_cache``."""
        init_params(self, seed, self._init_param)
        with torch.device("cpu"):
            cache = self._rope_cache()
        self.rope_cache = cache.to(self.rope_cache.device)

    def _init_param(self, fqn: str, w: torch.Tensor, g: torch.Generator) -> None:
        a = self.args
        if fqn == "tok_embeddings.weight":
            nn.init.normal_(w, std=1.0, generator=g)
        elif fqn == "output.weight":
            std = a.dim**-0.5
            nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std, generator=g)
        elif fqn.endswith("norm.weight"):
            nn.init.ones_(w)
        elif fqn.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight")):
            nn.init.trunc_normal_(w, std=0.02, generator=g)
        elif fqn.endswith(("wo.weight", "w2.weight", "w3.weight")):
            depth = 2 * (int(fqn.split(".")[1]) + 1) if a.depth_init else 2 * a.n_layers
            nn.init.trunc_normal_(w, std=0.02 / depth**0.5, generator=g)
        else:
            raise ValueError(f"no init rule for parameter {fqn!r}")
