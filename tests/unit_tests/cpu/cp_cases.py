"""Functions run on each rank by test_context_parallel.py (through titan_lightning.testing.spawn)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_lightning.parallel.context import ContextParallel, context_parallel_attention


def attention_parity(rank: int, world_size: int, *, backend: str, load_balancer, n_heads: int, n_kv_heads: int,
                     seq_len: int, batch: int = 2, head_dim: int = 8) -> dict:
    """Largest error of this rank's CP attention output and q/k/v gradients against full causal attention (fp64)."""
    g = torch.Generator().manual_seed(1234)
    q = torch.randn(batch, seq_len, n_heads, head_dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, seq_len, n_kv_heads, head_dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, seq_len, n_kv_heads, head_dim, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(batch, seq_len, n_heads, head_dim, generator=g, dtype=torch.float64)
    rep = n_heads // n_kv_heads
    reference = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2), v.repeat_interleave(rep, 2).transpose(1, 2),
        is_causal=True,
    ).transpose(1, 2)
    (reference * weight).sum().backward()

    cp = ContextParallel(group=dist.group.WORLD, rank=rank, size=world_size, load_balancer=load_balancer)
    local = [cp.shard(t.detach()).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, cp, backend)
    (out * cp.shard(weight)).sum().backward()

    def error(a, b):
        return (a - b).abs().max().item()

    return {
        "out": error(out, cp.shard(reference.detach())),
        "dq": error(local[0].grad, cp.shard(q.grad)),
        "dk": error(local[1].grad, cp.shard(k.grad)),
        "dv": error(local[2].grad, cp.shard(v.grad)),
        "scale": reference.abs().max().item(),
    }
