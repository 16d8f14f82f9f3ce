"""Ring attention for context parallelism: K and V travel around the CP group one block per step;
each block's partial attention is merged with an online softmax, and a hand-written backward
sends K/V around again (no S x S state kept).

Each rank's local sequence is made of equal chunks with global chunk ids (headtail: r and
2cp-1-r of 2cp chunks; contiguous: r of cp). A query chunk sees an earlier key chunk fully,
its own chunk causally, a later one not at all, so every (query chunk, key chunk) pair is
one plain or causal attention call that also returns its log-sum-exp. The forward merges
the pairs with an online softmax while K/V travel around the ring; the backward sends K/V
around again, calls each pair's backward kernel with the *final* output and log-sum-exp
(which makes every partial gradient exact), and passes the K/V gradients along with the
blocks, so that after cp shifts each block's gradient arrives back at its owner. Nothing
of size S_local x S_local is kept between forward and backward.

Document masking (block_causal) and sliding windows: every pair is masked by the global
document ids of its query and key chunks (all-gathered once per layer call, [B, S] integers)
and the chunks' positions (``visible``), and computed by the explicit math kernel, the one that
takes a mask: exact, not fast (a pair wholly outside every window is still computed). A query
row with no key of its document or window in a pair gets log-sum-exp -inf and output 0 there;
its own chunk's diagonal always holds the query itself, so the merged row is finite.
"""

import math
from typing import Optional

import torch

from titan_lightning.parallel.collectives import all_to_all
from titan_lightning.parallel.context_attention import visible
from titan_lightning.parallel.context_shard import ContextParallel, global_document_ids


def _chunk_ids(cp: ContextParallel, rank: int) -> list[int]:
    if cp.load_balancer == "headtail":
        return [rank, 2 * cp.size - 1 - rank]
    return [rank]


def _ring_kernel(q: torch.Tensor, v: torch.Tensor) -> str:
    """The fastest pair kernel for these inputs: CPU flash, CUDA flash, or explicit math."""
    same_dims = q.shape[-1] == v.shape[-1]
    if q.device.type == "cpu" and same_dims:
        return "cpu_flash"
    if q.is_cuda and same_dims and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0 \
            and q.shape[-1] <= 256:
        return "cuda_flash"
    return "math"


def _math_scores(q, k, causal: bool, scale: float, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scaled scores, -inf where masked: above the diagonal when ``causal``, and where ``mask``
    ([B, 1, S_q, S_k] bool, True = attend) says no."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the -inf of fully masked rows as 0 (so exp(scores - lse) is 0 there, not NaN)."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _pair_forward(kernel: str, q, k, v, causal: bool, scale: float, mask=None):
    """(out [B, H, S, Dv] in q's dtype, lse [B, H, S] fp32 or fp64, saved state for the backward)."""
    aten = torch.ops.aten
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    if kernel == "cuda_flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    scores = _math_scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - _finite(lse)[..., None]) @ v.to(scores.dtype)
    return out.to(q.dtype), lse, ()


def _pair_backward(kernel: str, grad, q, k, v, out, lse, state, causal: bool, scale: float, mask=None):
    """Gradients of q, k, v of one pair, given the merged output and log-sum-exp of q's rows."""
    aten = torch.ops.aten
    # Chunks are views into the whole local sequence; the kernels want dense inputs (the CUDA
    # flash backward reads the log-sum-exp as contiguous rows).
    grad, q, k, v, out, lse = (t.contiguous() for t in (grad, q, k, v, out, lse))
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, scale=scale)
    if kernel == "cuda_flash":
        cum_q, cum_k, max_q, max_k, seed, offset = state
        return aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    scores = _math_scores(q, k, causal, scale, mask)
    acc = scores.dtype
    p = torch.exp(scores - lse[..., None].to(acc))
    g = grad.to(acc)
    dv = p.transpose(-2, -1) @ g
    dp = g @ v.to(acc).transpose(-2, -1)
    ds = p * (dp - (g * out.to(acc)).sum(-1, keepdim=True))
    return (ds @ k.to(acc)) * scale, (ds.transpose(-2, -1) @ q.to(acc)) * scale, dv


def _shift(x: torch.Tensor, group, rank: int, size: int, step: int) -> torch.Tensor:
    """Send ``x`` to rank ``rank + step``, receive the block of rank ``rank - step`` (mod size)."""
    send, recv = [0] * size, [0] * size
    send[(rank + step) % size] = recv[(rank - step) % size] = x.shape[0]
    return all_to_all(x, group, recv, send)


def _ring_pairs(cp: ContextParallel, source: int):
    """(query chunk index, key chunk index, causal) of the pairs that attend, for K/V from ``source``."""
    mine, theirs = _chunk_ids(cp, cp.rank), _chunk_ids(cp, source)
    return [(a, b, ib == ia) for a, ia in enumerate(mine) for b, ib in enumerate(theirs) if ib <= ia]


def _ring_step(tensors: list[torch.Tensor], cp: ContextParallel, step: int) -> list[torch.Tensor]:
    return [_shift(t, cp.group, cp.rank, cp.size, step) for t in tensors]


class _RingAttention(torch.autograd.Function):
    """q [B, H, S, D], k/v [B, H_kv, S, D] (local, heads first) -> out [B, H, S, Dv]."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, documents: Optional[torch.Tensor] = None,
                window: Optional[int] = None, scale: Optional[float] = None):
        n_rep, n_chunks = q.shape[1] // k.shape[1], len(_chunk_ids(cp, cp.rank))
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        kernel = _ring_kernel(q, v) if documents is None and window is None else "math"
        chunk = q.shape[2] // n_chunks
        q_chunks = q.split(chunk, dim=2)
        outs: list = [None] * n_chunks
        lses: list = [None] * n_chunks
        block = [k, v]
        states = {}  # the CUDA flash kernel's per-call bookkeeping, for its backward
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            ks = _repeat_heads(block[0], n_rep).split(chunk, dim=2)
            vs = _repeat_heads(block[1], n_rep).split(chunk, dim=2)
            for a, b, causal in _ring_pairs(cp, source):
                mask = _pair_mask(documents, window, cp, source, a, b, chunk)
                out, lse, states[step, a, b] = _pair_forward(kernel, q_chunks[a], ks[b], vs[b], causal, scale, mask)
                acc = torch.promote_types(q.dtype, torch.float32)
                out, lse = out.to(acc), lse.to(acc)
                if outs[a] is None:
                    outs[a], lses[a] = out, lse
                else:
                    merged = torch.logaddexp(lses[a], lse)
                    shift = _finite(merged)  # (rows masked in every pair so far: both weights 0)
                    outs[a] = outs[a] * torch.exp(lses[a] - shift)[..., None] + out * torch.exp(lse - shift)[..., None]
                    lses[a] = merged
            if step + 1 < cp.size:
                block = _ring_step(block, cp, 1)
        out = torch.cat(outs, dim=2).to(q.dtype)
        lse = torch.cat(lses, dim=2)
        ctx.cp, ctx.kernel, ctx.scale, ctx.n_rep, ctx.chunk, ctx.states = cp, kernel, scale, n_rep, chunk, states
        ctx.documents, ctx.window = documents, window
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        cp, kernel, scale, n_rep, chunk = ctx.cp, ctx.kernel, ctx.scale, ctx.n_rep, ctx.chunk
        acc = torch.promote_types(q.dtype, torch.float32)
        grad = grad.contiguous()
        q_chunks, g_chunks, o_chunks = q.split(chunk, 2), grad.split(chunk, 2), out.split(chunk, 2)
        lse_chunks = lse.split(chunk, 2)  # in acc, the dtype the kernels return it in
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dq_chunks = dq.split(chunk, 2)
        block = [k, v, torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            ks = _repeat_heads(block[0], n_rep).split(chunk, dim=2)
            vs = _repeat_heads(block[1], n_rep).split(chunk, dim=2)
            dk, dv = block[2].split(chunk, 2), block[3].split(chunk, 2)
            for a, b, causal in _ring_pairs(cp, source):
                mask = _pair_mask(ctx.documents, ctx.window, cp, source, a, b, chunk)
                gq, gk, gv = _pair_backward(kernel, g_chunks[a], q_chunks[a], ks[b], vs[b], o_chunks[a],
                                            lse_chunks[a], ctx.states[step, a, b], causal, scale, mask)
                dq_chunks[a].add_(gq.to(acc))
                dk[b].add_(_sum_heads(gk.to(acc), n_rep))
                dv[b].add_(_sum_heads(gv.to(acc), n_rep))
            # K/V move on to the next rank with their gradient so far; after cp shifts the
            # gradient is back with the block's owner (K/V themselves need only cp - 1).
            block = _ring_step(block, cp, 1) if step + 1 < cp.size else [None, None, *_ring_step(block[2:], cp, 1)]
        return dq.to(q.dtype), block[2].to(k.dtype), block[3].to(v.dtype), None, None, None, None


def _pair_mask(documents: Optional[torch.Tensor], window: Optional[int], cp: ContextParallel, source: int,
               a: int, b: int, chunk: int) -> Optional[torch.Tensor]:
    """[B or 1, 1, chunk, chunk] bool: which keys of chunk ``b`` of ``source`` the queries of chunk
    ``a`` of this rank see (``documents``: [B, S] global document ids; ``window``: the sliding
    window), or None (no masking but the pair's causal flag)."""
    if documents is None and window is None:
        return None
    qa, kb = _chunk_ids(cp, cp.rank)[a], _chunk_ids(cp, source)[b]
    device = documents.device if documents is not None else None
    q_at = torch.arange(qa * chunk, (qa + 1) * chunk, device=device)
    k_at = torch.arange(kb * chunk, (kb + 1) * chunk, device=device)
    if documents is None:
        return visible(q_at, k_at, window)[None, None]
    return visible(q_at, k_at, window, documents[:, q_at], documents[:, k_at])[:, None]


def _repeat_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, H_kv * n_rep, S, D], each KV head serving n_rep query heads."""
    return x.repeat_interleave(n_rep, dim=1) if n_rep > 1 else x


def _sum_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The adjoint of ``_repeat_heads``."""
    if n_rep == 1:
        return x
    B, H, S, D = x.shape
    return x.view(B, H // n_rep, n_rep, S, D).sum(dim=2)


def ring_attention(q, k, v, cp: ContextParallel, position_ids: Optional[torch.Tensor] = None,
                   window: Optional[int] = None, scale: Optional[float] = None) -> torch.Tensor:
    documents = None
    if position_ids is not None:
        documents = global_document_ids(position_ids, cp, cp.gathered_order(q.shape[1], q.device))
    out = _RingAttention.apply(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                               v.transpose(1, 2).contiguous(), cp, documents, window, scale)
    return out.transpose(1, 2)
