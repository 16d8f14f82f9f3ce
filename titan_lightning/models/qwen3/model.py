"""Qwen 3 decoder (dense and mixture-of-experts), with torchtitan's submodule names.

Per block: pre-norm grouped-query attention with QK-norm (an RMSNorm over each head's
features of q and k, before RoPE), then either a dense SwiGLU (``feed_forward``) or a
``moe`` of routed SwiGLU experts (Qwen3-MoE: softmax router, top-k renormalized, no shared
experts). Unlike Llama, ``head_dim`` is its own field (128 in every published size), so
``n_heads * head_dim`` need not equal ``dim``.

Load balancing: Hugging Face Qwen3-MoE trains with an auxiliary loss; here the MoE uses
the auxiliary-loss-free expert bias of models/common/moe.py (``moe.load_balance_coeff``).
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from titan_lightning.config.job import ModelArgs
from titan_lightning.models.common import Attention, FeedForward, RMSNorm, init_params, precompute_rope_cache
from titan_lightning.models.common.moe import MoE, MoEArgs, reset_moe_buffers


@dataclass(kw_only=True)
class Qwen3Args(ModelArgs):
    """Qwen 3 architecture. The defaults are the dense debugmodel; presets.py has the published sizes."""

    n_kv_heads: int = 8
    dim: int = 256
    n_layers: int = 8
    head_dim: int = 64
    # Width of the dense SwiGLU (Hugging Face ``intermediate_size``); unused when ``moe`` is set.
    ffn_hidden_dim: int = 768
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 4096
    # RMSNorm of q and k per head (every published Qwen 3 has it).
    qk_norm: bool = True
    # None: dense; otherwise every block is a mixture of experts.
    moe: Optional[MoEArgs] = None
    # std of wo/w2/w3 (and the router): 0.02 / sqrt(2 * (layer_id + 1)) if True, else 0.02 / sqrt(2 * n_layers).
    depth_init: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("dim", "n_layers", "head_dim", "ffn_hidden_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name}={value!r} must be a positive integer")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"model.{name}={value!r} must be > 0")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even (RoPE rotates pairs of features)")
        if self.moe is not None:
            self.moe.__post_init__()


def count_parameters(args: Qwen3Args, *, active: bool = False) -> int:
    """Parameters of ``Transformer(args)``, by arithmetic (embeddings and output are not tied);
    ``active``: those one token uses (its ``top_k`` routed experts instead of all of them)."""
    d, q, kv = args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attention = 2 * d * q + 2 * d * kv + (2 * args.head_dim if args.qk_norm else 0)
    if args.moe is None:
        ffn = 3 * d * args.ffn_hidden_dim
    else:
        m = args.moe
        routed = m.top_k if active else m.num_experts
        ffn = d * m.num_experts + 3 * d * m.hidden_dim * (routed + m.num_shared_experts)
    return 2 * args.vocab_size * d + args.n_layers * (attention + ffn + 2 * d) + d


class TransformerBlock(nn.Module):
    """Pre-norm attention, then a dense SwiGLU (``feed_forward``) or a ``moe``; the other slot is
    None, so one tensor-parallel plan names both."""

    def __init__(self, args: Qwen3Args):
        super().__init__()
        qk_norm_eps = args.norm_eps if args.qk_norm else None
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(
            args.dim, args.n_heads, args.n_kv_heads, args.attention, head_dim=args.head_dim, qk_norm_eps=qk_norm_eps
        )
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # add_module keeps a None slot in _modules, where a plan pattern finds (and skips) it.
        self.add_module("feed_forward", FeedForward(args.dim, args.ffn_hidden_dim) if args.moe is None else None)
        self.add_module("moe", MoE(args.dim, args.moe) if args.moe is not None else None)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        ffn = self.feed_forward if self.feed_forward is not None else self.moe
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    """Qwen 3: token embeddings, pre-norm GQA (QK-norm) blocks with SwiGLU or MoE, final norm,
    untied output.

    Build it on the meta device, shard it, then ``to_empty(device=...)`` and
    ``init_weights(seed)``. ``layers`` is a ModuleDict keyed "0", "1", ... so a pipeline
    stage can delete blocks and keep the names; a stage may also set ``tok_embeddings``,
    ``norm`` or ``output`` to None, and then takes or returns hidden states [B, S, dim].

    ``rope_cache`` is a non-persistent float32 buffer [max_seq_len, head_dim // 2, 2] rebuilt
    by ``init_weights``; casting the whole model to bfloat16 afterwards would round it too.
    """

    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def _rope_cache(self) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab_size], in the dtype of the parameters."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_weights(self, seed: int) -> None:
        """Draw every parameter from (seed, its name), as in torchtitan; zero the MoE buffers;
        rebuild ``rope_cache``."""
        init_params(self, seed, self._init_param)
        reset_moe_buffers(self)
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
        elif fqn.endswith("norm.weight"):  # attention_norm, ffn_norm, q_norm, k_norm, norm
            nn.init.ones_(w)
        elif fqn.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "experts.w1")):
            nn.init.trunc_normal_(w, std=0.02, generator=g)
        elif fqn.endswith(("wo.weight", "w2.weight", "w3.weight", "experts.w2", "experts.w3", "router.gate.weight")):
            depth = 2 * (int(fqn.split(".")[1]) + 1) if a.depth_init else 2 * a.n_layers
            nn.init.trunc_normal_(w, std=0.02 / depth**0.5, generator=g)
        else:
            raise ValueError(f"no init rule for parameter {fqn!r}")
