"""gpt-oss decoder (OpenAI's gpt-oss-20b / 120b), with torchtitan's submodule names.

Per block: pre-norm grouped-query attention with biases on q, k, v and o, attention sinks (a
learned logit per query head in each softmax denominator: weights exp(s_j) / (sum_j exp(s_j) +
exp(sink_h))), sliding-window (128) and full layers alternating (``model.layer_types``), then a
mixture of experts: a router with a bias picks each token's top k of the experts and weighs them
by a softmax over the k chosen logits (= the softmax over all, renormalized over the k:
``score_func="softmax"``, ``route_norm``), each expert a clamped SwiGLU with biases
(models/common/moe.py ``activation="clamped_swiglu"``). RoPE with YaRN (``GptOssYarn``: context
stretched 32x from 4096 positions), which also scales q and k by its attention factor.

Load balancing: Hugging Face gpt-oss trains with an auxiliary loss (``router_aux_loss_coef``); the
MoE here has the auxiliary-loss-free expert bias instead (``moe.load_balance_coeff``), which
gpt-oss's checkpoint has no place for, so a model read from a config.json trains without either.
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from titan_lightning.config.job import ModelArgs
from titan_lightning.models.common import Attention, rope_frequencies
from titan_lightning.models.common.attention import ATTENTION_TP_PLAN
from titan_lightning.models.common.decoder import Decoder, decoder_tp_plan
from titan_lightning.models.common.moe import MOE_TP_PLAN, MoE, MoEArgs

# Llama's attention entries plus the sinks, split with the query heads.
TP_PLAN: dict[str, str] = decoder_tp_plan({**ATTENTION_TP_PLAN, "sinks": "head_params"}, MOE_TP_PLAN)


@dataclass(kw_only=True)
class GptOssYarn:
    """YaRN RoPE as transformers computes it (``_compute_yarn_parameters``): the feature pairs that
    turn more than ``beta_fast`` times over ``original_max_position_embeddings`` positions keep
    their frequency, those turning fewer than ``beta_slow`` times are slowed ``factor`` times, a
    linear ramp between (its ends rounded outward when ``truncate``); cos and sin are scaled by
    ``attention_factor`` (None: 0.1 ln(factor) + 1)."""

    factor: float = 32.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = False
    attention_factor: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("factor", "beta_fast", "beta_slow"):
            if not getattr(self, name) > 0:
                raise ValueError(f"model.rope_scaling.{name}={getattr(self, name)!r} must be > 0")
        n = self.original_max_position_embeddings
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"model.rope_scaling.original_max_position_embeddings={n!r} must be a positive integer")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"model.rope_scaling.attention_factor={self.attention_factor!r} must be > 0 or None")

    @property
    def scale(self) -> float:
        """The factor on cos and sin (so q.k scales by its square)."""
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


def yarn_frequencies(head_dim: int, theta: float, yarn: GptOssYarn) -> torch.Tensor:
    """Angular frequency of each feature pair under ``yarn``, [head_dim // 2] float32."""
    def pair(rotations: float) -> float:  # the (fractional) feature that turns ``rotations`` times
        n = yarn.original_max_position_embeddings
        return head_dim * math.log(n / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair(yarn.beta_fast), pair(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    freqs = rope_frequencies(head_dim, theta)
    return freqs / yarn.factor * ramp + freqs * (1 - ramp)


@dataclass(kw_only=True)
class GptOssArgs(ModelArgs):
    """gpt-oss architecture. The defaults are the debugmodel; presets.py has the published sizes."""

    n_heads: int = 8
    n_kv_heads: int = 2
    dim: int = 256
    n_layers: int = 4
    head_dim: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    # None: plain RoPE.
    rope_scaling: Optional[GptOssYarn] = field(default_factory=lambda: GptOssYarn(factor=4.0,
                                                                                 original_max_position_embeddings=1024))
    max_seq_len: int = 4096
    moe: MoEArgs = field(default_factory=lambda: gpt_oss_moe(num_experts=8, top_k=2, hidden_dim=256))
    sliding_window: Optional[int] = 32
    layer_types: Optional[list[str]] = field(default_factory=lambda: alternating(4))
    # std of wo/w2/w3 (and the router): 0.02 / sqrt(2 * (layer_id + 1)) if True, else 0.02 / sqrt(2 * n_layers).
    depth_init: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_positive_ints("dim", "n_layers", "head_dim", "max_seq_len")
        self.require_positive("norm_eps", "rope_theta")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even (RoPE rotates pairs of features)")
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise ValueError(f"model.layer_types has {len(self.layer_types)} entries; model.n_layers={self.n_layers} "
                             f"needs one per layer")
        if self.rope_scaling is not None:
            self.rope_scaling.__post_init__()
        self.moe.__post_init__()


def gpt_oss_moe(*, num_experts: int, top_k: int, hidden_dim: int, load_balance_coeff: Optional[float] = 1e-3) -> MoEArgs:
    """gpt-oss's MoE: router and expert biases, softmax over the top k, clamped SwiGLU, no shared experts."""
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, num_shared_experts=0,
                   score_func="softmax", route_norm=True, load_balance_coeff=load_balance_coeff, router_bias=True,
                   expert_biases=True, activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=7.0)


def alternating(n_layers: int) -> list[str]:
    """gpt-oss's layer types: sliding-window attention in the even layers, full in the odd ones."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]


class Sinks(nn.Module):
    """The sink logit of each query head, [n_heads] (a module of its own, so a tensor-parallel plan
    shards it with the heads: ``head_params``); ``forward`` gives the local heads' entries."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def forward(self) -> torch.Tensor:
        w = self.weight
        return w.to_local() if hasattr(w, "to_local") else w


class GptOssAttention(Attention):
    """``Attention`` with biases on q, k, v and o, and attention sinks (``Sinks``, which ``Attention``
    hands to its kernel), on the kernels that take them: sdpa (one more key, ``sdpa_with_sinks``),
    flex (its log-sum-exp) and, under context parallelism, allgather (refused elsewhere before launch)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, attention: str = "sdpa", *, head_dim: int):
        super().__init__(dim, n_heads, n_kv_heads, attention, head_dim=head_dim, qkv_bias=True)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=True)
        self.sinks = Sinks(n_heads)


class Transformer(Decoder):
    """gpt-oss: token embeddings, pre-norm blocks of GQA with sinks and an MoE, final norm, untied
    output (models/common/decoder.py has the skeleton)."""

    args_class, plan = GptOssArgs, TP_PLAN

    def build_attention(self, layer_id: int) -> GptOssAttention:
        a = self.args
        return GptOssAttention(a.dim, a.n_heads, a.n_kv_heads, a.attention, head_dim=a.head_dim)

    def build_rope_cache(self) -> torch.Tensor:
        a = self.args
        if a.rope_scaling is None:
            freqs, scale = rope_frequencies(a.head_dim, a.rope_theta), 1.0
        else:
            freqs, scale = yarn_frequencies(a.head_dim, a.rope_theta, a.rope_scaling), a.rope_scaling.scale
        angles = torch.outer(torch.arange(a.max_seq_len, dtype=torch.float32), freqs)
        return torch.stack((angles.cos() * scale, angles.sin() * scale), dim=-1)

    def init_param(self, fqn: str, w: torch.Tensor, g: torch.Generator) -> None:
        """The sinks and the experts' biases start at zero (a sink of 0 still adds exp(0) to each
        denominator); the rest as every family's."""
        if fqn.endswith(("sinks.weight", "experts.b1", "experts.b2", "experts.b3")):
            nn.init.zeros_(w)
        else:
            super().init_param(fqn, w, g)

    @classmethod
    def count_parameters(cls, args: GptOssArgs, *, active: bool = False) -> int:
        """Embeddings and output are not tied; ``active``: a token's ``top_k`` experts instead of all."""
        d, q, kv, m = args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.moe
        attention = (d + 1) * q + 2 * (d + 1) * kv + q * d + d + args.n_heads
        expert = 3 * d * m.hidden_dim + 2 * m.hidden_dim + d
        ffn = (d + 1) * m.num_experts + expert * (m.top_k if active else m.num_experts)
        return 2 * args.vocab_size * d + args.n_layers * (attention + ffn + 2 * d) + d
