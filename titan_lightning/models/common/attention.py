from typing import Optional

import torch
from torch import nn

from titan_lightning.models.common.kv_cache import KVCache
from titan_lightning.models.common.masking import Documents, attend, rope_at
from titan_lightning.models.common.norms import RMSNorm
from titan_lightning.models.common.projection import project
from titan_lightning.models.common.rope import apply_rope
from titan_lightning.parallel.context import ContextParallel, context_parallel_attention

# Tensor-parallel plan entries inside ``layers.*.attention`` (parallel/tensor_styles.py styles):
# each rank holds n_heads/tp query heads and n_kv_heads/tp key/value heads.
ATTENTION_TP_PLAN: dict[str, str] = {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"}


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE on queries and keys.

    Each key/value head serves ``n_heads // n_kv_heads`` consecutive query heads. Heads are
    counted from the projection outputs, so the module also runs on the local heads of a
    tensor-parallel shard of wq/wk/wv/wo.

    ``head_dim`` defaults to ``dim // n_heads``; Qwen 3 sets it independently of ``dim``.
    ``qkv_bias`` (Qwen 2): wq, wk and wv add a bias (wo has none); a tensor-parallel plan
    shards each bias with the rows of its projection.
    ``qk_norm_eps`` turns on QK-norm (Qwen 3): an RMSNorm over each head's features of the
    queries (``q_norm``) and the keys (``k_norm``), before RoPE; one weight of [head_dim]
    is shared by all heads. None (the default) means no QK-norm, and no such submodules.

    ``scale`` multiplies the scores (None: ``head_dim ** -0.5``; Gemma 3's ``query_pre_attn_scalar ** -0.5``).

    ``window`` makes it sliding-window attention (a query at i sees keys i - window < j <= i);
    None attends to every earlier key. The decoder sets it per layer from
    ``ModelArgs.attention_window``.

    ``attention`` is a kernel ("sdpa", "flex", "varlen": models/common/masking.py) or a
    context-parallel backend ("allgather", "ring", "ulysses");
    a strategy with cp > 1 sets ``cp`` (the group and the slicing), and then the module's
    input is this rank's slice of the sequence: RoPE takes the slice's global positions.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        attention: str = "sdpa",
        *,
        head_dim: Optional[int] = None,
        qk_norm_eps: Optional[float] = None,
        window: Optional[int] = None,
        qkv_bias: bool = False,
        scale: Optional[float] = None,
    ):
        super().__init__()
        self.backend = attention
        self.window = window
        self.scale = scale
        self.cp: Optional[ContextParallel] = None
        self.head_dim = head_dim if head_dim is not None else dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        qk_norm = qk_norm_eps is not None
        self.q_norm = RMSNorm(self.head_dim, qk_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, qk_norm_eps) if qk_norm else None
        # A module giving each local query head's sink logit ([heads]: gpt-oss), or None.
        self.sinks: Optional[nn.Module] = None
        # Decoding (models/common/kv_cache.py) sets a KVCache: the input then follows its tokens.
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, *, documents: Optional[Documents] = None) -> torch.Tensor:
        """``documents``: the batch's document boundaries when ``model.mask`` / ``model.positions``
        ask for them (models/common/masking.py); None is causal attention at window positions."""
        B, S, _ = x.shape
        q, k, v = (t.view(B, S, -1, self.head_dim) for t in project(x, self.wq, self.wk, self.wv))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        sinks = self.sinks() if self.sinks is not None else None
        if self.kv_cache is not None:
            rope_cache = self.kv_cache.rope(rope_cache, S)
            q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
            y = self.kv_cache.attend(q, k, v, scale=self.scale, window=self.window, sinks=sinks)
            return self.wo(y.reshape(B, S, -1))
        if self.cp is not None:
            if documents is not None and documents.per_document:  # this rank's tokens' own positions
                rope_cache = rope_at(rope_cache, documents, S)
            else:
                rope_cache = rope_cache.index_select(0, self.cp.positions(S, x.device))
            q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
            return self.wo(context_parallel_attention(q, k, v, self.cp, self.backend, documents, self.window, sinks,
                                                      scale=self.scale).reshape(B, S, -1))
        if documents is not None:
            rope_cache = rope_at(rope_cache, documents, S)
        q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
        return self.wo(attend(q, k, v, documents, scale=self.scale, window=self.window, sinks=sinks).reshape(B, S, -1))
