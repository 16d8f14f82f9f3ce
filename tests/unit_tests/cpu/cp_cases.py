"""Functions run on each rank by test_context_parallel.py (through titan_lightning.testing.spawn)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_lightning.parallel.context import ContextParallel, context_parallel_attention


def _full_attention(q, k, v, weight):
    """Unsharded causal attention of leaf copies of q/k/v; returns (out, dq, dk, dv) for loss sum(out * weight)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2), v.repeat_interleave(rep, 2).transpose(1, 2),
        is_causal=True,
    ).transpose(1, 2)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def attention_parity(rank: int, world_size: int, *, backend: str, load_balancer, n_heads: int, n_kv_heads: int,
                     seq_len: int, batch: int = 2, head_dim: int = 8, device: str = "cpu",
                     dtype: str = "float64") -> dict:
    """Largest error of this rank's CP attention output and q/k/v gradients against full causal attention.

    The reference is fp64. In a lower precision ``baseline_*`` is the error of unsharded
    attention in that precision, the yardstick for the CP error.
    """
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(1234)
    q = torch.randn(batch, seq_len, n_heads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seq_len, n_kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seq_len, n_kv_heads, head_dim, generator=g, dtype=torch.float64)
    weight = torch.randn(batch, seq_len, n_heads, head_dim, generator=g, dtype=torch.float64)
    q, k, v, weight = (t.to(device) for t in (q, k, v, weight))
    reference = _full_attention(q, k, v, weight)

    cp = ContextParallel(group=dist.group.WORLD, rank=rank, size=world_size, load_balancer=load_balancer)
    local = [cp.shard(t.to(dtype)).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, cp, backend)
    (out * cp.shard(weight.to(dtype))).sum().backward()

    def error(a, b):
        return (a.double() - b).abs().max().item()

    names = ("out", "dq", "dk", "dv")
    errors = {name: error(mine, cp.shard(ref)) for name, mine, ref in
              zip(names, (out, *(t.grad for t in local)), reference)}
    errors["scale"] = reference[0].abs().max().item()
    if dtype != torch.float64:
        low = _full_attention(q.to(dtype), k.to(dtype), v.to(dtype), weight.to(dtype))
        errors.update({f"baseline_{name}": error(cp.shard(mine), cp.shard(ref))
                       for name, mine, ref in zip(names, low, reference)})
    return errors
