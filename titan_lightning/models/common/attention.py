from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from titan_lightning.models.common.rope import apply_rope
from titan_lightning.parallel.context import ContextParallel, context_parallel_attention


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE on queries and keys.

    Each key/value head serves ``n_heads // n_kv_heads`` consecutive query heads. Heads are
    counted from the projection outputs, so the module also runs on the local heads of a
    tensor-parallel shard of wq/wk/wv/wo.

    ``attention`` is "sdpa" or a context-parallel backend ("allgather", "ring", "ulysses");
    a strategy with cp > 1 sets ``cp`` (the group and the slicing), and then the module's
    input is this rank's slice of the sequence: RoPE takes the slice's global positions.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, attention: str = "sdpa"):
        super().__init__()
        self.backend = attention
        self.cp: Optional[ContextParallel] = None
        self.head_dim = dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, -1, self.head_dim)
        k = self.wk(x).view(B, S, -1, self.head_dim)
        v = self.wv(x).view(B, S, -1, self.head_dim)
        if self.cp is not None:
            rope_cache = rope_cache.index_select(0, self.cp.positions(S, x.device))
            q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
            return self.wo(context_parallel_attention(q, k, v, self.cp, self.backend).reshape(B, S, -1))
        q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
        if self.n_rep > 1:
            k, v = k.repeat_interleave(self.n_rep, dim=2), v.repeat_interleave(self.n_rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))
