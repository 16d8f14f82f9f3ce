"""Context parallelism: each rank of the ``cp`` group holds a slice of every sequence.

Sequences are sliced load-balanced for causal attention: with ``headtail`` the sequence is
cut into ``2 * cp`` chunks and rank r holds chunks r and ``2 * cp - 1 - r`` (one cheap and
one expensive chunk each); with ``None`` rank r holds the r-th contiguous slice. Tokens,
labels and RoPE positions are sliced the same way, so every rank computes exact causal
attention for its queries with one of three backends:

- ``allgather``: gather K and V from the whole group (autograd: gradients reduce-scattered
  back), then each contiguous run of local queries attends the keys before it
  (``causal_lower_right``: SDPA's flash/efficient kernels on GPU);
- ``ring``: K and V travel around the group, one block per step; each block's partial
  attention (flash kernels that return their log-sum-exp) is merged with an online
  softmax, and a hand-written backward sends K/V around again (no S x S state kept);
- ``ulysses``: all-to-all from sequence-sharded to head-sharded, plain causal attention over
  the whole sequence, and back; needs the local head counts divisible by ``cp``.

Every backend also honours document masking (``block_causal``) and a sliding window (a query
at i sees keys i - window < j <= i), through ``visible``: the one rule of which keys a query
may see, which the kernels of models/common/masking.py use too.

Collectives are functional collectives inside autograd Functions (torch's own
``context_parallel()`` does not run on CPU); under the fake process group they write
deterministic values (parallel/fake.py patches the entry points used here).
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from titan_lightning.config.job import CP_ATTENTIONS
from titan_lightning.parallel import value_free
from titan_lightning.parallel.collectives import all_gather_autograd, all_reduce, all_to_all, all_to_all_autograd
from titan_lightning.parallel.contracts import attention_modules


# -- which tokens a rank holds -------------------------------------------------------------


def shard_positions(seq_len: int, cp: int, rank: int, load_balancer: Optional[str] = "headtail",
                    device: Optional[torch.device] = None) -> torch.Tensor:
    """Global positions (int64, increasing) of the tokens CP rank ``rank`` holds."""
    if load_balancer == "headtail":
        if seq_len % (2 * cp):
            raise ValueError(f"sequence length {seq_len} must be divisible by 2 * cp = {2 * cp} for headtail")
        c = seq_len // (2 * cp)
        head = torch.arange(rank * c, (rank + 1) * c, device=device)
        tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
        return torch.cat([head, tail])
    if load_balancer is None:
        if seq_len % cp:
            raise ValueError(f"sequence length {seq_len} must be divisible by cp = {cp}")
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    raise ValueError(f"cp_load_balancer={load_balancer!r}: this attention supports 'headtail' or None")


def _runs(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """Contiguous runs of ``positions``: (local start, local end, global end) each."""
    values = positions.tolist()
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append((start, i, values[i - 1] + 1))
            start = i
    return runs


@dataclass
class ContextParallel:
    """The CP group of one rank and how sequences are sliced over it."""

    group: dist.ProcessGroup
    rank: int
    size: int
    load_balancer: Optional[str] = "headtail"
    # Index tensors per (what, local_len, device, rank): every attention layer of every step
    # asks for the same ones.
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def _cached(self, key: tuple, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def positions(self, local_len: int, device: torch.device, rank: Optional[int] = None) -> torch.Tensor:
        """Global positions of the ``local_len`` tokens of ``rank`` (default: this rank)."""
        rank = self.rank if rank is None else rank
        return self._cached(("positions", local_len, device, rank), lambda: shard_positions(
            local_len * self.size, self.size, rank, self.load_balancer, device))

    def gathered_order(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The permutation that sorts the ranks' slices, concatenated in rank order, by position."""
        return self._cached(("order", local_len, device), lambda: torch.argsort(
            torch.cat([self.positions(local_len, device, r) for r in range(self.size)])))

    def runs(self, local_len: int, device: torch.device) -> list[tuple[int, int, int]]:
        """This rank's contiguous runs of positions (computed once: it reads the positions on the host)."""
        return self._cached(("runs", local_len, device), lambda: _runs(self.positions(local_len, device)))

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of a full-sequence tensor (tokens, labels) along ``dim``."""
        seq_len = tensor.shape[dim]
        positions = shard_positions(seq_len, self.size, self.rank, self.load_balancer, tensor.device)
        return tensor.index_select(dim, positions)


class _SliceSum(torch.autograd.Function):
    """``all_reduce`` whose backward hands each rank's part the gradient of the sum unchanged."""

    @staticmethod
    def forward(ctx, parts: torch.Tensor, group) -> torch.Tensor:
        return all_reduce(parts, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sequence_sums(parts: torch.Tensor, group) -> torch.Tensor:
    """The whole of a per-sequence sum (a sequence's log-probability) from each CP rank's ``parts``,
    the sums over its slice of every sequence; differentiable. Every rank goes on with the same
    wholes to the same loss, so each rank's part takes that loss's gradient of the whole as it is:
    summed over the ranks by the gradient reduction, the gradients are the whole's, once."""
    return _SliceSum.apply(parts, group)


def _shift(x: torch.Tensor, group, rank: int, size: int, step: int) -> torch.Tensor:
    """Send ``x`` to rank ``rank + step``, receive the block of rank ``rank - step`` (mod size)."""
    send, recv = [0] * size, [0] * size
    send[(rank + step) % size] = recv[(rank - step) % size] = x.shape[0]
    return all_to_all(x, group, recv, send)


# -- attention -----------------------------------------------------------------------------


def visible(q_positions: torch.Tensor, k_positions: torch.Tensor, window: Optional[int] = None,
            q_documents: Optional[torch.Tensor] = None, k_documents: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[..., S_q, S_k] bool, True where the query at ``q_positions`` may attend to the key at
    ``k_positions``: the key is not later, within the sliding ``window`` (i - window < j <= i, as
    Hugging Face's ``sliding_window``; None: any distance) and, given documents ([..., S] ids),
    in the query's document."""
    q, k = q_positions[..., :, None], k_positions[..., None, :]
    mask = k <= q
    if window is not None:
        mask = mask & (k > q - window)
    if q_documents is not None:
        mask = mask & (q_documents[..., :, None] == k_documents[..., None, :])
    return mask


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x.repeat_interleave(n_rep, dim=2) if n_rep > 1 else x


def sdpa_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                    scale: Optional[float] = None) -> torch.Tensor:
    """SDPA over [B, H, S_q, D] / [B, H, S_k, D] (heads already repeated) where each head's softmax
    denominator also holds exp(``sinks[h]``) (gpt-oss's attention sinks): one more key, whose value
    is zero and whose score is ``sinks[h]``. The score comes from one more feature (padded to a
    multiple of 8 for the GPU kernels): 1 in every query, 0 in every key but the sink's, which holds
    ``sinks[h] / scale``; so ``mask`` [..., S_q, S_k] bool (True = attend) only gains a True column
    and stays shared by the heads. Exact; differentiable in ``sinks``."""
    B, H, S_q, D = q.shape
    scale = D**-0.5 if scale is None else scale
    extra = 8 - D % 8
    q = torch.cat([q, q.new_ones(B, H, S_q, 1), q.new_zeros(B, H, S_q, extra - 1)], dim=-1)
    k = F.pad(k, (0, extra))
    sink = torch.zeros(B, H, 1, D + extra, dtype=k.dtype, device=k.device)
    sink[..., D] = (sinks.to(k.dtype) / scale).view(1, H, 1)
    k = torch.cat([k, sink], dim=2)
    v = torch.cat([v, v.new_zeros(B, H, 1, v.shape[-1])], dim=2)
    mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, backend: str, documents=None,
    window: Optional[int] = None, sinks: Optional[torch.Tensor] = None, *, scale: Optional[float] = None,
) -> torch.Tensor:
    """Exact causal attention of this rank's queries over the whole sequence.

    ``q`` [B, S_local, H, D], ``k``/``v`` [B, S_local, H_kv, D] (H a multiple of H_kv, GQA),
    all already rotated. Returns [B, S_local, H, D]. ``documents`` (models/common/masking.py:
    this rank's slice of the batch's ``position_ids`` and whether attention is block-causal)
    keeps each query inside its document; ``window`` (None: none) inside its sliding window
    (every backend honours both); ``scale`` multiplies the scores (None: ``D ** -0.5``). ``sinks`` [H]
    (gpt-oss: ``sdpa_with_sinks``): allgather only.
    """
    if sinks is not None and backend != "allgather":
        raise ValueError(f"context-parallel attention backend {backend!r} has no attention sinks; use allgather")
    position_ids = documents.position_ids if documents is not None and documents.block_causal else None
    if window is not None and window >= q.shape[1] * cp.size:  # the window holds the whole sequence
        window = None
    if backend == "allgather":
        return _allgather_attention(q, k, v, cp, position_ids, window, sinks, scale)
    if backend == "ring":
        return _ring_attention(q, k, v, cp, position_ids, window, scale)
    if backend == "ulysses":
        return _ulysses_attention(q, k, v, cp, position_ids, window, scale)
    raise ValueError(f"context-parallel attention backend {backend!r} is not one of {', '.join(CP_ATTENTIONS)}")


def _allgather_attention(q, k, v, cp: ContextParallel, position_ids: Optional[torch.Tensor] = None,
                         window: Optional[int] = None, sinks: Optional[torch.Tensor] = None,
                         scale: Optional[float] = None) -> torch.Tensor:
    local = q.shape[1]
    order = cp.gathered_order(local, q.device)
    n_rep = q.shape[2] // k.shape[2]
    # Gather before repeating the KV heads: GQA sends n_heads / n_kv_heads times less.
    k_all = _repeat_kv(all_gather_autograd(k, 1, cp.group)[:, order], n_rep).transpose(1, 2)
    v_all = _repeat_kv(all_gather_autograd(v, 1, cp.group)[:, order], n_rep).transpose(1, 2)
    q = q.transpose(1, 2)
    documents = None
    if position_ids is not None:
        documents = _global_document_ids(position_ids, cp, order)
        mine = documents[:, cp.positions(local, q.device)]
    outs = []
    for start, end, global_end in cp.runs(local, q.device):
        # Queries at positions [global_end - (end - start), global_end) see keys [0, global_end);
        # with a window, keys from the first query's position - window + 1 on.
        first = global_end - (end - start)
        keys = 0 if window is None else max(0, first - window + 1)
        assumed = value_free.assumed()  # (while tensors hold no values: parallel/value_free.py)
        mask = causal_lower_right(end - start, global_end) if assumed is None or assumed.lower_right_mask else None
        if documents is not None or window is not None or sinks is not None:  # ... of their document, in their window
            q_at = torch.arange(first, global_end, device=q.device)
            k_at = torch.arange(keys, global_end, device=q.device)
            if documents is None:
                mask = visible(q_at, k_at, window)
            else:
                mask = visible(q_at, k_at, window, mine[:, start:end], documents[:, keys:global_end])[:, None]
        if sinks is not None:
            outs.append(sdpa_with_sinks(q[:, :, start:end], k_all[:, :, keys:global_end], v_all[:, :, keys:global_end],
                                        mask, sinks, scale))
            continue
        outs.append(F.scaled_dot_product_attention(q[:, :, start:end], k_all[:, :, keys:global_end],
                                                   v_all[:, :, keys:global_end], attn_mask=mask, scale=scale))
    return torch.cat(outs, dim=2).transpose(1, 2)


# -- ring attention ------------------------------------------------------------------------
#
# Each rank's local sequence is made of equal chunks with global chunk ids (headtail: r and
# 2cp-1-r of 2cp chunks; contiguous: r of cp). A query chunk sees an earlier key chunk fully,
# its own chunk causally, a later one not at all, so every (query chunk, key chunk) pair is
# one plain or causal attention call that also returns its log-sum-exp. The forward merges
# the pairs with an online softmax while K/V travel around the ring; the backward sends K/V
# around again, calls each pair's backward kernel with the *final* output and log-sum-exp
# (which makes every partial gradient exact), and passes the K/V gradients along with the
# blocks, so that after cp shifts each block's gradient arrives back at its owner. Nothing
# of size S_local x S_local is kept between forward and backward.
#
# Document masking (block_causal) and sliding windows: every pair is masked by the global
# document ids of its query and key chunks (all-gathered once per layer call, [B, S] integers)
# and the chunks' positions (``visible``), and computed by the explicit math kernel, the one that
# takes a mask: exact, not fast (a pair wholly outside every window is still computed). A query
# row with no key of its document or window in a pair gets log-sum-exp -inf and output 0 there;
# its own chunk's diagonal always holds the query itself, so the merged row is finite.


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


def _ring_attention(q, k, v, cp: ContextParallel, position_ids: Optional[torch.Tensor] = None,
                    window: Optional[int] = None, scale: Optional[float] = None) -> torch.Tensor:
    documents = None
    if position_ids is not None:
        documents = _global_document_ids(position_ids, cp, cp.gathered_order(q.shape[1], q.device))
    out = _RingAttention.apply(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                               v.transpose(1, 2).contiguous(), cp, documents, window, scale)
    return out.transpose(1, 2)


def _to_heads(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[B, S_local, H, D] sequence-sharded -> [B, S, H / cp, D] head-sharded, positions sorted."""
    B, S, H, D = x.shape
    parts = x.view(B, S, cp.size, H // cp.size, D).permute(2, 0, 1, 3, 4)  # [cp, B, S_local, H/cp, D]
    gathered = all_to_all_autograd(parts, cp.group)  # chunk j: rank j's tokens, my heads
    whole = gathered.permute(1, 0, 2, 3, 4).reshape(B, cp.size * S, H // cp.size, D)
    return whole[:, cp.gathered_order(S, x.device)]


def _to_sequence(x: torch.Tensor, cp: ContextParallel, local: int) -> torch.Tensor:
    """Inverse of ``_to_heads``: [B, S, H / cp, D] -> [B, S_local, H, D]."""
    B, _, h, D = x.shape
    unsorted = x[:, torch.argsort(cp.gathered_order(local, x.device))]
    parts = unsorted.view(B, cp.size, local, h, D).permute(1, 0, 2, 3, 4)  # chunk j: rank j's tokens
    back = all_to_all_autograd(parts, cp.group)  # chunk j: my tokens, rank j's heads
    return back.permute(1, 2, 0, 3, 4).reshape(B, local, cp.size * h, D)


def _global_document_ids(position_ids: torch.Tensor, cp: ContextParallel, order: torch.Tensor) -> torch.Tensor:
    """[B, S]: the document of every token of the whole sequence (a new one after every position
    0), from every rank's slice of the positions (``order`` sorts the gathered slices)."""
    gathered = all_gather_autograd(position_ids.contiguous(), 1, cp.group)[:, order]
    return torch.cumsum(gathered == 0, dim=1)


def _ulysses_attention(q, k, v, cp: ContextParallel, position_ids: Optional[torch.Tensor] = None,
                       window: Optional[int] = None, scale: Optional[float] = None) -> torch.Tensor:
    local = q.shape[1]
    if q.shape[2] % cp.size or k.shape[2] % cp.size:
        raise ValueError(
            f"ulysses attention needs the local query heads ({q.shape[2]}) and KV heads ({k.shape[2]}) "
            f"divisible by cp={cp.size}"
        )
    n_rep = q.shape[2] // k.shape[2]
    qh, kh, vh = (_to_heads(t, cp) for t in (q, k, v))
    mask = None
    if position_ids is not None or window is not None:  # the whole sequence is here: mask it whole
        ids = None if position_ids is None else _global_document_ids(position_ids, cp, cp.gathered_order(local, q.device))
        at = torch.arange(qh.shape[1], device=q.device)
        mask = visible(at, at, window) if ids is None else visible(at, at, window, ids, ids)[:, None]
    out = F.scaled_dot_product_attention(
        qh.transpose(1, 2), _repeat_kv(kh, n_rep).transpose(1, 2), _repeat_kv(vh, n_rep).transpose(1, 2),
        is_causal=mask is None, attn_mask=mask, scale=scale,
    )
    return _to_sequence(out.transpose(1, 2), cp, local)


def apply_context_parallel(model: torch.nn.Module, mesh, load_balancer: Optional[str]) -> ContextParallel:
    """Give every attention module of ``model`` the CP group; refuse models that cannot do CP.

    Attention modules are those with ``backend`` and ``cp`` attributes (contracts.CPAttention).
    All must use one context-parallel backend.
    """
    size = mesh.size()
    modules = attention_modules(model, size)
    context = ContextParallel(group=mesh.get_group(), rank=mesh.get_local_rank(), size=size,
                              load_balancer=load_balancer)
    for module in modules:
        module.cp = context
    return context
