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

The work is in three rooms below this one: context_shard.py (which tokens a rank holds, the
load balancers), context_attention.py (``visible``, all-gather, Ulysses) and context_ring.py.
"""

from typing import Optional

import torch

from titan_lightning.config.job import CP_ATTENTIONS
from titan_lightning.parallel.collectives import all_reduce
from titan_lightning.parallel.context_attention import (  # noqa: F401 (re-exported: their home before the split)
    allgather_attention, sdpa_with_sinks, ulysses_attention, visible,
)
from titan_lightning.parallel.context_ring import ring_attention
from titan_lightning.parallel.context_shard import ContextParallel, shard_positions  # noqa: F401 (re-exported)
from titan_lightning.parallel.contracts import attention_modules


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
        return allgather_attention(q, k, v, cp, position_ids, window, sinks, scale)
    if backend == "ring":
        return ring_attention(q, k, v, cp, position_ids, window, scale)
    if backend == "ulysses":
        return ulysses_attention(q, k, v, cp, position_ids, window, scale)
    raise ValueError(f"context-parallel attention backend {backend!r} is not one of {', '.join(CP_ATTENTIONS)}")


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
