"""DeepSeek V3: multi-head latent attention (MLA) and mixture-of-experts blocks, with the
submodule names of torchtitan and DeepSeek's reference.

MLA, per token (H heads; nope/rope/v the head dims, r_q/r_kv the latent ranks):

    q             wq(x), or wq_b(q_norm(wq_a(x)))        [H, nope + rope]  (r_q = 0: no compression)
    kv, k_pe      wkv_a(x) split                         [r_kv], [rope]   (k_pe: one key for all heads)
    k_nope, v     wkv_b(kv_norm(kv)) split per head      [H, nope], [H, v]
    RoPE          on q's last ``rope`` features and on k_pe (adjacent pairs, models/common/rope.py)
    attention     causal, keys [k_nope, k_pe], softmax scale (nope + rope)^-0.5 * YaRN mscale^2
    out           wo(attention [H * v])
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from titan_lightning.config.job import ModelArgs
from titan_lightning.models.common import FeedForward, RMSNorm, apply_rope, rope_frequencies
from titan_lightning.models.common.decoder import Block, Decoder
from titan_lightning.models.common.masking import Documents, attend, rope_at
from titan_lightning.models.common.moe import MoE, MoEArgs
from titan_lightning.models.deepseek_v3.parallelize import deepseek_v3_tp_plan
from titan_lightning.parallel.context import context_parallel_attention


def _debug_moe() -> MoEArgs:
    return MoEArgs(num_experts=8, top_k=3, hidden_dim=256, num_shared_experts=2)


@dataclass(kw_only=True)
class DeepSeekV3Args(ModelArgs):
    """DeepSeek V3 architecture. The defaults are the debugmodel; presets.py has the published sizes.

    Every head has its own key and value (``n_kv_heads == n_heads``). Layers below
    ``n_dense_layers`` use a dense SwiGLU of width ``inter_dim``, the others ``moe``.
    """

    dim: int = 256
    n_layers: int = 6
    n_dense_layers: int = 1
    inter_dim: int = 1024
    norm_eps: float = 1e-5
    # eps of the latent norms (q_norm, kv_norm); None: norm_eps. Hugging Face's model uses 1e-6
    # there whatever its rms_norm_eps.
    latent_norm_eps: Optional[float] = None
    max_seq_len: int = 16384
    # MLA: 0 = queries straight from wq, no low-rank compression.
    q_lora_rank: int = 0
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    # RoPE, with YaRN when max_seq_len > original_seq_len (then the softmax scale gets mscale too).
    rope_theta: float = 10000.0
    original_seq_len: int = 4096
    rope_factor: float = 40.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.70
    moe: MoEArgs = field(default_factory=_debug_moe)
    # std of wo/w2/w3 (and the router): 0.02 / sqrt(2 * (layer_id + 1)) if True, else 0.02 / sqrt(2 * n_layers).
    depth_init: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_positive_ints("dim", "n_layers", "inter_dim", "max_seq_len", "kv_lora_rank", "qk_nope_head_dim",
                                   "qk_rope_head_dim", "v_head_dim", "original_seq_len")
        self.require_positive_ints("n_dense_layers", "q_lora_rank", minimum=0)
        if self.n_dense_layers > self.n_layers:
            raise ValueError(f"model.n_dense_layers={self.n_dense_layers} must be <= model.n_layers={self.n_layers}")
        self.require_positive("norm_eps", "latent_norm_eps", "rope_theta", "rope_factor", "beta_fast", "beta_slow",
                              "mscale")
        if self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"model.n_kv_heads={self.n_kv_heads} must equal model.n_heads={self.n_heads}: "
                f"MLA gives every head its own key and value"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_eps(self) -> float:
        return self.norm_eps if self.latent_norm_eps is None else self.latent_norm_eps

    @property
    def uses_yarn(self) -> bool:
        return self.max_seq_len > self.original_seq_len

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.uses_yarn:
            scale *= (0.1 * self.mscale * math.log(self.rope_factor) + 1.0) ** 2
        return scale


def yarn_rope_cache(args: DeepSeekV3Args) -> torch.Tensor:
    """(cos, sin) for every position, [max_seq_len, qk_rope_head_dim // 2, 2] float32.

    YaRN (DeepSeek's variant): feature pairs that turn fewer than ``beta_slow`` times over
    ``original_seq_len`` positions are slowed ``rope_factor`` times, those that turn more
    than ``beta_fast`` times are kept, and a linear ramp blends the band in between.
    """
    d = args.qk_rope_head_dim
    freqs = rope_frequencies(d, args.rope_theta)
    if args.uses_yarn:
        def pair_index(rotations: float) -> float:  # the pair that turns ``rotations`` times
            return d * math.log(args.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(args.rope_theta))

        low = max(math.floor(pair_index(args.beta_fast)), 0)
        high = min(math.ceil(pair_index(args.beta_slow)), d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
        freqs = freqs / args.rope_factor * ramp + freqs * (1 - ramp)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


class MultiHeadLatentAttention(nn.Module):
    """MLA with causal attention; see the module docstring for the dataflow.

    Heads are counted from the projection outputs, so the module also runs on the local
    heads of a tensor-parallel shard of wq/wq_b/wkv_b/wo. ``backend`` is "sdpa" or a
    context-parallel backend; a strategy with cp > 1 sets ``cp``, and then the input is this
    rank's slice of the sequence and RoPE takes the slice's global positions.
    """

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.backend = args.attention
        self.cp = None
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.softmax_scale = args.softmax_scale
        qk_dim = args.qk_head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, args.latent_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, args.latent_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        # The rotary key is shared by every head; a no-op here, it is where tensor parallelism
        # sums its gradient over the ranks' local heads (the "head_shared" TP style).
        self.k_pe_shared = nn.Identity()

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, *, documents: Optional[Documents] = None) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora_rank else self.wq(x)
        q = q.view(B, S, -1, self.nope_dim + self.rope_dim)  # [B, S, H, nope + rope]
        H = q.shape[2]
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(B, S, H, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [B, S, H, nope], [B, S, H, v]
        if documents is not None and documents.per_document:
            rope_cache = rope_at(rope_cache, documents, S)
        elif self.cp is not None:
            rope_cache = rope_cache.index_select(0, self.cp.positions(S, x.device))
        q = torch.cat([q_nope, apply_rope(q_pe, rope_cache)], dim=-1)
        k_pe = apply_rope(self.k_pe_shared(k_pe).unsqueeze(2), rope_cache)  # [B, S, 1, rope]: one key for every head
        k = torch.cat([k_nope, k_pe.expand(-1, -1, H, -1)], dim=-1)
        if self.cp is not None:
            # The CP backends scale scores by (nope + rope)^-0.5: the YaRN correction rides on q.
            q = q * (self.softmax_scale * q.shape[-1] ** 0.5)
            y = context_parallel_attention(q, k, v, self.cp, self.backend, documents)
        else:
            y = attend(q, k, v, documents, scale=self.softmax_scale)
        return self.wo(y.reshape(B, S, -1))  # y [B, S, H, v]


class Transformer(Decoder):
    """DeepSeek V3: token embeddings, pre-norm MLA blocks (dense first, then MoE), final norm,
    untied output (models/common/decoder.py has the skeleton)."""

    args_class = DeepSeekV3Args
    sliding_window = False  # (multi-head latent attention: no window)
    input_projections = Decoder.input_projections + ("wq_a.weight", "wq_b.weight", "wkv_a.weight", "wkv_b.weight")

    def build_block(self, layer_id: int) -> Block:
        a = self.args
        ffn = FeedForward(a.dim, a.inter_dim) if layer_id < a.n_dense_layers else MoE(a.dim, a.moe)
        return Block(a.dim, a.norm_eps, MultiHeadLatentAttention(a), ffn)

    def build_rope_cache(self) -> torch.Tensor:
        return yarn_rope_cache(self.args)

    @classmethod
    def tp_plan(cls, args: DeepSeekV3Args) -> dict[str, str]:
        return deepseek_v3_tp_plan(args)

    @classmethod
    def count_parameters(cls, args: DeepSeekV3Args, *, active: bool = False) -> int:
        """Parameters of ``Transformer(args)`` by arithmetic (embeddings and output are not tied).

        ``active``: those one token computes with: its ``top_k`` routed experts instead of all of
        them, and not the embedding table (a row lookup). This is how DeepSeek's published counts
        come out: 671B total / 37B active, and DeepSeek-V2-Lite's 15.7B / 2.4B.
        """
        d, h, m = args.dim, args.n_heads, args.moe
        if args.q_lora_rank:
            q = d * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * h * args.qk_head_dim
        else:
            q = d * h * args.qk_head_dim
        kv = d * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank
        kv += args.kv_lora_rank * h * (args.qk_nope_head_dim + args.v_head_dim)
        attention = q + kv + h * args.v_head_dim * d + 2 * d  # + attention_norm, ffn_norm
        routed = m.top_k if active else m.num_experts
        moe = d * m.num_experts + 3 * d * m.hidden_dim * (routed + m.num_shared_experts)
        n_moe = args.n_layers - args.n_dense_layers
        layers = args.n_layers * attention + args.n_dense_layers * 3 * d * args.inter_dim + n_moe * moe
        return (1 if active else 2) * args.vocab_size * d + layers + d

    @classmethod
    def flop_terms(cls, args: DeepSeekV3Args) -> tuple[int, int]:
        # The active count already leaves out the embedding table.
        return cls.count_parameters(args, active=True), args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim)
