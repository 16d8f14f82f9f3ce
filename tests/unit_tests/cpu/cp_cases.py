"""Functions run on each rank by test_context_parallel.py (through titan_lightning.testing.spawn) and
by the GPU CP tests (thread ranks)."""

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_lightning.parallel.context import ContextParallel, context_parallel_attention


def _full_attention(q, k, v, weight, mask=None, scale=None):
    """Unsharded causal (or ``mask``ed: [B, 1, S, S]) attention of leaf copies of q/k/v (scores times
    ``scale``, None: head_dim ** -0.5); returns (out, dq, dk, dv) for loss sum(out * weight)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2), v.repeat_interleave(rep, 2).transpose(1, 2),
        is_causal=mask is None, attn_mask=mask, scale=scale,
    ).transpose(1, 2)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def make_inputs(*, n_heads: int, n_kv_heads: int, seq_len: int, batch: int = 2, head_dim: int = 8,
                device: str = "cpu") -> tuple:
    """q, k, v and the output weighting (the loss is sum(out * weight)), fp64, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    shapes = [(batch, seq_len, h, head_dim) for h in (n_heads, n_kv_heads, n_kv_heads, n_heads)]
    return tuple(torch.randn(s, generator=g, dtype=torch.float64).to(device) for s in shapes)


def references(inputs: tuple, dtype: str = "float64", mask=None, scale=None) -> dict:
    """The fp64 reference (out, dq, dk, dv) and, in a lower ``dtype``, unsharded attention in that dtype."""
    return {"reference": _full_attention(*inputs, mask=mask, scale=scale),
            "low": in_precision(inputs, dtype, mask, scale)}


def in_precision(inputs: tuple, dtype: str, mask=None, scale=None) -> Optional[tuple]:
    """Unsharded attention (out, dq, dk, dv) computed in ``dtype``; None for fp64 (the reference itself)."""
    low_dtype = getattr(torch, dtype)
    return None if low_dtype == torch.float64 else _full_attention(*(t.to(low_dtype) for t in inputs), mask=mask,
                                                                   scale=scale)


def document_positions(lengths: list[list[int]], device: str = "cpu") -> torch.Tensor:
    """[B, S] positions of packed documents of these lengths (one list per row)."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(device)


def attention_parity(rank: int, world_size: int, *, backend: str, load_balancer, n_heads: int, n_kv_heads: int,
                     seq_len: int, batch: int = 2, head_dim: int = 8, device: str = "cpu",
                     dtype: str = "float64", precomputed: Optional[dict] = None,
                     documents: Optional[list[list[int]]] = None, window: Optional[int] = None,
                     scale: Optional[float] = None) -> dict:
    """Largest error of this rank's CP attention output and q/k/v gradients against full causal attention
    (with ``documents``, lengths of packed documents per row: full block-causal attention; with a sliding
    ``window``: full sliding-window attention; ``scale``: scores times it, not head_dim ** -0.5).

    The reference is fp64. In a lower precision ``baseline_*`` is the error of unsharded
    attention in that precision, the yardstick for the CP error. ``precomputed``: the
    ``references`` of the same inputs (thread ranks share them; computed by the caller).
    """
    inputs = make_inputs(n_heads=n_heads, n_kv_heads=n_kv_heads, seq_len=seq_len, batch=batch, head_dim=head_dim,
                         device=device)
    masked = mask = None
    if documents is not None:
        from titan_lightning.models.common.masking import Documents, block_causal_mask

        positions = document_positions(documents, device)
        masked = Documents(positions, block_causal=True, per_document=False)
        mask = block_causal_mask(positions)
    if window is not None:
        from titan_lightning.models.common.masking import sliding_mask

        mask = sliding_mask(None if masked is None else masked.position_ids, seq_len, window, device)
    refs = precomputed if precomputed is not None else references(inputs, dtype, mask, scale)
    low_dtype = getattr(torch, dtype)
    q, k, v, weight = inputs
    cp = ContextParallel(group=dist.group.WORLD, rank=rank, size=world_size, load_balancer=load_balancer)
    local = [cp.shard(t.to(low_dtype)).requires_grad_() for t in (q, k, v)]
    if masked is not None:
        masked = masked._replace(position_ids=cp.shard(masked.position_ids))
    out = context_parallel_attention(*local, cp, backend, masked, window, scale=scale)
    (out * cp.shard(weight.to(low_dtype))).sum().backward()

    def error(a, b):
        return (a.double() - b).abs().max().item()

    names = ("out", "dq", "dk", "dv")
    errors = {name: error(mine, cp.shard(ref)) for name, mine, ref in
              zip(names, (out, *(t.grad for t in local)), refs["reference"])}
    errors["scale"] = refs["reference"][0].abs().max().item()
    if refs["low"] is not None:
        errors.update({f"baseline_{name}": error(cp.shard(mine), cp.shard(ref))
                       for name, mine, ref in zip(names, refs["low"], refs["reference"])})
    return errors
