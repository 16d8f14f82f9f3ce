"""Context-parallel attention over the whole sequence brought to each rank: ``allgather``
(gather K and V, each contiguous run of local queries attends the keys before it) and
``ulysses`` (all-to-all from sequence-sharded to head-sharded and back); with ``visible``, the
one rule of which keys a query may see (models/common/masking.py's kernels use it too), and
``sdpa_with_sinks`` (gpt-oss's attention sinks)."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from titan_lightning.parallel import value_free
from titan_lightning.parallel.collectives import all_gather_autograd, all_to_all_autograd
from titan_lightning.parallel.context_shard import ContextParallel, global_document_ids


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


def allgather_attention(q, k, v, cp: ContextParallel, position_ids: Optional[torch.Tensor] = None,
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
        documents = global_document_ids(position_ids, cp, order)
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


def ulysses_attention(q, k, v, cp: ContextParallel, position_ids: Optional[torch.Tensor] = None,
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
        ids = None if position_ids is None else global_document_ids(position_ids, cp, cp.gathered_order(local, q.device))
        at = torch.arange(qh.shape[1], device=q.device)
        mask = visible(at, at, window) if ids is None else visible(at, at, window, ids, ids)[:, None]
    out = F.scaled_dot_product_attention(
        qh.transpose(1, 2), _repeat_kv(kh, n_rep).transpose(1, 2), _repeat_kv(vh, n_rep).transpose(1, 2),
        is_causal=mask is None, attn_mask=mask, scale=scale,
    )
    return _to_sequence(out.transpose(1, 2), cp, local)
