"""The LM head and its cross entropy in one pass over chunks of tokens: full logits never exist.

``linear_cross_entropy(h, weight, labels, chunks=n)`` equals ``F.cross_entropy((h @ weight.T).float(),
labels, ignore_index=IGNORE_INDEX)`` (the mean over the labelled tokens; with ``reduction="sum"`` their sum, what
loss-masked fine-tuning divides by the supervised tokens of a whole step; with ``reduction="none"`` each token's,
0 where unlabelled, what preference losses sum per sequence; with ``softcap``, of the logits
``tanh(logits / softcap) * softcap``, Gemma's) and its gradients, but holds one
chunk of ``N / n`` token rows' logits at a time. The forward computes each chunk's logits in the
compute dtype, their fp32 log-sum-exp and the chunk's loss, and keeps only the log-sum-exp (4 bytes
a token) besides ``h`` and ``weight`` (alive anyway); the backward computes each chunk's logits
again, then (softmax - one-hot) / labelled tokens into the gradients of ``h`` and ``weight``. The
price is one more head matmul per step (the forward's, again in the backward); the gain is that
nothing logits-sized lives from forward to backward, where the activations peak.

(Computing the gradients in the forward instead, as Liger's fused linear cross entropy does,
saves that matmul but keeps a weight-sized gradient alive through the forward's peak: on the
Llama 3 8B shape, one device, fp32 parameters, exactly as much as the plain loss's bf16 logits,
by ``titan-lightning estimate``.)

Precision is that of the plain path: under autocast (or with bf16 inputs) the matmuls run in
bf16 and everything after them in fp32; the weight's gradient is summed over the chunks in fp32.

Tensor parallelism: a vocab-sharded DTensor weight (the TP style ``output``: ``Shard(0)`` on a
1-D mesh) makes each rank compute its vocab shard's logits; per chunk one all-gather over the
TP ranks combines the log-sum-exp and the label's logit (2 floats per token row). The
gradient of ``h`` is each rank's part of a sum: it goes back as a ``Partial`` DTensor, summed
where the hidden states were gathered.
"""

import functools
from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Partial, Shard

from titan_lightning.parallel.collectives import all_gather

IGNORE_INDEX = -100  # a label the loss skips (padding, a document's last token)


REDUCTIONS = ("mean", "sum", "none")


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunks: int,
                         ignore_index: int = IGNORE_INDEX, reduction: str = "mean",
                         softcap: Optional[float] = None) -> torch.Tensor:
    """Cross entropy of ``h @ weight.T`` [..., V] (soft-capped to ``tanh(. / softcap) * softcap`` when
    ``softcap`` is set) against ``labels`` [...] over the tokens whose label is not ``ignore_index``
    (their mean, or with ``reduction="sum"`` their sum), computed ``chunks`` token rows at a time; fp32, 0-d
    (``reduction="none"``: each token's [...], 0 where the label is ``ignore_index``)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        mesh, placements = weight.device_mesh, tuple(weight.placements)
        if placements == (Shard(0),):
            vocab = weight.shape[0]
            rows = -(-vocab // mesh.size())  # DTensor's shards: torch.chunk's sizes
            group, vocab_start = mesh.get_group(), min(mesh.get_local_rank() * rows, vocab)
        elif not all(p.is_replicate() for p in placements):
            raise ValueError(
                f"linear_cross_entropy: head weight placements {placements}; expected Shard(0) on a 1-D "
                f"mesh (vocab-parallel) or replicated"
            )
        weight = weight.to_local()
    if isinstance(h, DTensor):
        if not all(p.is_replicate() for p in h.placements):
            raise ValueError(f"linear_cross_entropy: hidden states placed {tuple(h.placements)}; expected replicated")
        h = h.to_local(grad_placements=[Partial()] * h.device_mesh.ndim if group is not None else None)
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.promote_types(h.dtype, weight.dtype)
    loss = _LinearCrossEntropy.apply(h.flatten(0, -2), weight, labels.flatten(), chunks, dtype, group,
                                     vocab_start, ignore_index, reduction, softcap)
    return loss.view(labels.shape) if reduction == "none" else loss


def _chunk_bounds(n_tokens: int, chunks: int) -> list[tuple[int, int]]:
    count = max(min(chunks, n_tokens), 1)
    return [(n_tokens * i // count, n_tokens * (i + 1) // count) for i in range(count)]


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: each chunk's logits, their log-sum-exp (kept: [tokens] fp32) and the loss. Backward:
    each chunk's logits again, then (softmax - one-hot) / labelled tokens into both gradients (per
    token: times each token's gradient, for ``reduction="none"``)."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunks, dtype, group, vocab_start, ignore_index, reduction, softcap):
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(dtype), weight.to(dtype)
            valid = labels != ignore_index
            lse_all = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            losses = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device) if reduction == "none" else None
            chunk_forward = _kernels(h.is_cuda)[0]
            for first, last in _chunk_bounds(h.shape[0], chunks):
                lse, target = chunk_forward(hc[first:last], wc, labels[first:last], vocab_start, softcap)
                if group is not None:
                    parts = all_gather(torch.stack([lse, target]).unsqueeze(0), 0, group)  # [tp, 2, rows]
                    lse, target = torch.logsumexp(parts[:, 0], dim=0), parts[:, 1].sum(dim=0)
                lse_all[first:last] = lse
                token_losses = torch.where(valid[first:last], lse - target, 0.0)
                if losses is not None:
                    losses[first:last] = token_losses
                else:
                    loss = loss + token_losses.sum()
        ctx.save_for_backward(h, weight, labels, lse_all)
        ctx.chunks, ctx.dtype, ctx.vocab_start, ctx.ignore_index = chunks, dtype, vocab_start, ignore_index
        ctx.reduction, ctx.softcap = reduction, softcap
        if reduction == "none":
            return losses
        return loss if reduction == "sum" else loss / valid.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, labels, lse_all = ctx.saved_tensors
        dtype = ctx.dtype
        hc, wc = h.to(dtype), weight.to(dtype)
        valid = labels != ctx.ignore_index
        scale = grad_loss / valid.sum() if ctx.reduction == "mean" else grad_loss
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        chunk_grad = _kernels(h.is_cuda)[1]
        slices = _chunk_bounds(weight.shape[0], WEIGHT_SLICES)
        for first, last in _chunk_bounds(h.shape[0], ctx.chunks):
            x = hc[first:last]
            rows = scale[first:last] if ctx.reduction == "none" else scale
            grad = chunk_grad(x, wc, lse_all[first:last], labels[first:last], rows, ctx.vocab_start,
                              ctx.ignore_index, ctx.softcap)
            if grad_h is not None:
                grad_h[first:last] = grad @ wc
            if grad_weight is not None:  # in slices of the vocab: no weight-sized temporary
                for v0, v1 in slices:
                    grad_weight[v0:v1].add_(grad[:, v0:v1].T @ x)
        if grad_weight is not None and grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_h, grad_weight, *(None,) * 8


# The weight's gradient is summed in fp32 over the token chunks, a quarter of the vocab at a time
# (a bf16 product of a quarter of the head's size is the largest temporary).
WEIGHT_SLICES = 4


def _capped(logits: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _chunk_forward(x, w, labels, vocab_start: int, softcap: Optional[float] = None):
    """One chunk's fp32 log-sum-exp over this rank's vocab and the logit of each label it holds (0
    where the label is another rank's)."""
    logits = _capped((x @ w.T).float(), softcap)
    index, mine = _label_index(labels, vocab_start, w.shape[0])
    lse = torch.logsumexp(logits, dim=1)
    return lse, logits.gather(1, index).squeeze(1).masked_fill(~mine, 0.0)


def _chunk_grad(x, w, lse, labels, scale, vocab_start: int, ignore_index: int, softcap: Optional[float] = None):
    """d loss / d logits of one chunk, (softmax - one-hot) x scale (a number, or one per row) on
    labelled rows (times the soft cap's derivative 1 - tanh^2), in x's dtype."""
    if softcap is None:
        grad = ((x @ w.T).float() - lse.unsqueeze(1)).exp()
    else:
        tanh = torch.tanh((x @ w.T).float() / softcap)
        grad = (tanh * softcap - lse.unsqueeze(1)).exp()
    index, mine = _label_index(labels, vocab_start, w.shape[0])
    grad = grad.scatter_add(1, index, -mine.unsqueeze(1).to(grad.dtype))
    if softcap is not None:
        grad = grad * (1 - tanh**2)
    return (grad * ((labels != ignore_index).to(grad.dtype) * scale).unsqueeze(1)).to(x.dtype)


@functools.lru_cache(maxsize=2)
def _kernels(compiled: bool):
    """(chunk forward, chunk gradient): compiled on GPU, so that each chunk's fp32 epilogue (the
    cast, log-sum-exp, softmax, one-hot and scale) is one fused pass over its logits; eager
    elsewhere (the CPU tests' exactness, and no compiler on the CPU's path)."""
    if not compiled:
        return _chunk_forward, _chunk_grad
    return torch.compile(_chunk_forward, dynamic=False), torch.compile(_chunk_grad, dynamic=False)


def _label_index(labels: torch.Tensor, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label's column in this rank's vocab shard [rows, 1] (clamped), and whether it is there."""
    local = labels - vocab_start
    mine = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1).unsqueeze(1), mine
