"""Gemma 3 text decoder (Hugging Face ``Gemma3ForCausalLM``), with torchtitan's submodule names.

What differs from Llama, each as in transformers:

- RMSNorm scales by ``1 + w`` (the weights start at zero), computed in float32 before the cast;
  four per block: before and after attention, before and after the feed-forward
  (``h = x + post_attention_norm(attention(attention_norm(x)))``,
  ``out = h + post_ffn_norm(feed_forward(ffn_norm(h)))``).
- GeGLU: ``w2(gelu_tanh(w1(x)) * w3(x))``.
- Embeddings times ``sqrt(dim)``, the factor rounded to the embeddings' dtype first.
- Scores scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``); QK-norm per head
  (the same ``1 + w`` RMSNorm) before RoPE.
- Sliding-window layers (``sliding_window``, ``layer_types``: five local to one global in the
  released sizes) rotate with their own base, ``rope_local_theta``; the global layers with
  ``rope_theta`` and positions divided by ``rope_factor`` (linear scaling: 8 from 4B on).
- Logits soft-capped (``final_logit_softcapping``) when set; no released Gemma 3 sets it.
- The output is tied to the embeddings in every release; here it is its own weight that a
  loaded folder starts as a copy of (as Qwen 2's small sizes).
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from titan_lightning.models.common import Attention, FeedForward, rope_frequencies
from titan_lightning.models.common.args import DecoderArgs
from titan_lightning.models.common.decoder import Block, Decoder, _documents
from titan_lightning.models.common.masking import Documents
from titan_lightning.models.common.projection import project
from titan_lightning.models.gemma3.parallelize import TP_PLAN


@dataclass(kw_only=True)
class Gemma3Args(DecoderArgs):
    """Gemma 3 architecture. The defaults are the debugmodel's shape (presets.py adds its sliding
    layers) and the published sizes. ``ffn_hidden_dim`` is the GeGLU's width; ``rope_theta`` the
    global (full-attention) layers' RoPE base."""

    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 32
    # The global layers' linear position scaling; the sliding layers' RoPE base.
    rope_factor: float = 1.0
    rope_local_theta: float = 10000.0
    # Scores are scaled by query_pre_attn_scalar ** -0.5 (Hugging Face's name).
    query_pre_attn_scalar: float = 32.0
    # tanh(logits / c) * c; None: plain logits (Hugging Face ``final_logit_softcapping``).
    final_logit_softcapping: Optional[float] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_positive("rope_local_theta", "rope_factor", "query_pre_attn_scalar")
        if self.final_logit_softcapping is not None:
            self.require_positive("final_logit_softcapping")


def gemma3_layer_types(n_layers: int, pattern: int = 6) -> list[str]:
    """Hugging Face's default ``layer_types``: every ``pattern``-th layer global, the others sliding."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]


def _rope_table(head_dim: int, max_seq_len: int, theta: float, factor: float = 1.0) -> torch.Tensor:
    """(cos, sin) of pos * freq_i / factor (Hugging Face's "linear" RoPE scaling; 1: none):
    [max_seq_len, head_dim // 2, 2] float32."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rope_frequencies(head_dim, theta) / factor)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


class GemmaRMSNorm(nn.Module):
    """RMS normalization scaled by ``1 + weight``, all in float32, then cast to the input dtype
    (Hugging Face ``Gemma3RMSNorm``: the weight starts at zero)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).type_as(x)


class GeGLU(FeedForward):
    """``w2(gelu_tanh(w1(x)) * w3(x))``: the SwiGLU's projections with GELU (tanh approximation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.w1, self.w3)
        return self.w2(F.gelu(gate, approximate="tanh") * up)


class ScaledEmbedding(nn.Embedding):
    """Embeddings times ``sqrt(dim)``, the factor first rounded to the weights' dtype (55.4256 is
    55.5 in bfloat16), as transformers does."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * _rounded_sqrt(self.embedding_dim, self.weight.dtype)


@functools.lru_cache(maxsize=8)
def _rounded_sqrt(dim: int, dtype: torch.dtype) -> float:
    return torch.tensor(dim**0.5, dtype=dtype).item()


class GemmaAttention(Attention):
    """``Attention`` with Gemma's QK-norm (``1 + w``) and its score scale."""

    def __init__(self, a: Gemma3Args):
        super().__init__(a.dim, a.n_heads, a.n_kv_heads, a.attention, head_dim=a.head_dim, qk_norm_eps=a.norm_eps,
                         scale=a.query_pre_attn_scalar**-0.5)
        self.q_norm, self.k_norm = GemmaRMSNorm(a.head_dim, a.norm_eps), GemmaRMSNorm(a.head_dim, a.norm_eps)


class GemmaBlock(Block):
    """Norms before and after attention and the feed-forward. ``local``: the layer slides, and
    rotates with the local RoPE table (row 1 of the decoder's ``rope_cache``; row 0: global)."""

    def __init__(self, a: Gemma3Args, local: bool):
        super().__init__(a.dim, a.norm_eps, GemmaAttention(a), GeGLU(a.dim, a.ffn_hidden_dim))
        self.attention_norm, self.ffn_norm = GemmaRMSNorm(a.dim, a.norm_eps), GemmaRMSNorm(a.dim, a.norm_eps)
        self.post_attention_norm = GemmaRMSNorm(a.dim, a.norm_eps)
        self.post_ffn_norm = GemmaRMSNorm(a.dim, a.norm_eps)
        self.local = local

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, *,
                documents: Optional[Documents] = None) -> torch.Tensor:
        rope = rope_cache[int(self.local)]
        h = x + self.post_attention_norm(self.attention(self.attention_norm(x), rope, **_documents(documents)))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


class Transformer(Decoder):
    """Gemma 3: scaled embeddings, blocks of four norms with QK-normed GQA (local or global) and
    GeGLU, final norm, soft-capped untied output (models/common/decoder.py has the skeleton)."""

    args_class, plan = Gemma3Args, TP_PLAN

    def __init__(self, args: Gemma3Args):
        super().__init__(args)
        self.tok_embeddings = ScaledEmbedding(args.vocab_size, args.dim)
        self.norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.output.softcap = args.final_logit_softcapping

    def build_block(self, layer_id: int) -> GemmaBlock:
        return GemmaBlock(self.args, local=self.args.attention_window(layer_id) is not None)

    def build_rope_cache(self) -> torch.Tensor:
        """[2, max_seq_len, head_dim // 2, 2]: the global layers' table, then the sliding layers'."""
        a = self.args
        return torch.stack((_rope_table(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_factor),
                            _rope_table(a.head_dim, a.max_seq_len, a.rope_local_theta)))

    def init_param(self, fqn: str, w: torch.Tensor, g: torch.Generator) -> None:
        """Norm weights start at zero (a scale of one); the embeddings at N(0, 1 / dim), so that
        the scaled ones start at unit RMS; the rest as every decoder."""
        if fqn.endswith("norm.weight"):
            nn.init.zeros_(w)
        elif fqn == "tok_embeddings.weight":
            nn.init.normal_(w, std=self.args.dim**-0.5, generator=g)
        else:
            super().init_param(fqn, w, g)
