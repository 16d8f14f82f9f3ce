"""The LM head and its cross entropy in one pass over chunks of tokens: full logits never exist.

``linear_cross_entropy(h, weight, labels, chunks=n)`` equals ``F.cross_entropy((h @ weight.T).float(),
labels, ignore_index=IGNORE_INDEX)`` (the mean over the labelled tokens) and its gradients, but holds one
chunk of ``N / n`` token rows' logits at a time. The forward computes each chunk's logits in the
compute dtype, their fp32 log-sum-exp, the chunk's loss, and at once the chunk's gradients
(softmax - one-hot) / labelled tokens, multiplied into the gradients of ``h`` and ``weight``; the
backward only scales those by the incoming gradient. Each of the head's three matmuls runs
once, as without chunking (no recompute), and what lives from forward to backward is one
h-sized and one weight-sized gradient (the weight's is the one backward would make anyway).

Precision is that of the plain path: under autocast (or with bf16 inputs) the matmuls run in
bf16 and everything after them in fp32; the weight's gradient is summed over the chunks in fp32.

Tensor parallelism: a vocab-sharded DTensor weight (the TP style ``output``: ``Shard(0)`` on a
1-D mesh) makes each rank compute its vocab shard's logits; per chunk one all-gather over the
TP ranks combines the log-sum-exp and the label's logit (2 floats per token row). The
gradient of ``h`` is each rank's part of a sum: it goes back as a ``Partial`` DTensor, summed
where the hidden states were gathered.
"""

import torch
from torch.distributed.tensor import DTensor, Partial, Shard

from titan_lightning.parallel.collectives import all_gather

IGNORE_INDEX = -100  # a label the loss skips (padding, a document's last token)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunks: int,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross entropy of ``h @ weight.T`` [..., V] against ``labels`` [...] over the tokens whose
    label is not ``ignore_index``, computed ``chunks`` token rows at a time; fp32, 0-d."""
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
    with_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(h.flatten(0, -2), weight, labels.flatten(), chunks, dtype, group,
                                     vocab_start, ignore_index, with_grad)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunks, dtype, group, vocab_start, ignore_index, with_grad):
        with torch.autocast(h.device.type, enabled=False):
            loss, grad_h, grad_weight = _chunked(h, weight, labels, chunks, dtype, group, vocab_start,
                                                 ignore_index, with_grad)
        if with_grad:
            ctx.save_for_backward(grad_h, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # Scaled in place (no second weight-sized tensor): this backward runs once per forward.
        grad_h, grad_weight = ctx.saved_tensors
        return grad_h.mul_(grad_loss), grad_weight.mul_(grad_loss), *(None,) * 7


def _chunked(h, weight, labels, chunks, dtype, group, vocab_start, ignore_index, with_grad):
    """(loss, d loss / d h, d loss / d weight); the gradients are None without ``with_grad``."""
    n_tokens, local_vocab = h.shape[0], weight.shape[0]
    hc, wc = h.to(dtype), weight.to(dtype)
    valid = labels != ignore_index
    scale = 1.0 / valid.sum().float()
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if with_grad else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if with_grad else None
    count = max(min(chunks, n_tokens), 1)
    for i in range(count):
        first, last = n_tokens * i // count, n_tokens * (i + 1) // count
        x, label, keep = hc[first:last], labels[first:last], valid[first:last]
        logits = (x @ wc.T).float()
        local = label - vocab_start
        mine = (local >= 0) & (local < local_vocab)
        index = local.clamp(0, local_vocab - 1).unsqueeze(1)
        lse = torch.logsumexp(logits, dim=1)
        target = logits.gather(1, index).squeeze(1).masked_fill(~mine, 0.0)
        if group is not None:
            parts = all_gather(torch.stack([lse, target]).unsqueeze(0), 0, group)  # [tp, 2, rows]
            lse, target = torch.logsumexp(parts[:, 0], dim=0), parts[:, 1].sum(dim=0)
        loss = loss + torch.where(keep, lse - target, 0.0).sum()
        if not with_grad:
            continue
        grad = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
        grad.scatter_add_(1, index, -mine.unsqueeze(1).to(grad.dtype))
        grad.mul_((keep.to(grad.dtype) * scale).unsqueeze(1))
        grad = grad.to(dtype)
        grad_h[first:last] = grad @ wc
        grad_weight.add_(grad.T @ x)
    if with_grad and grad_weight.dtype != weight.dtype:
        grad_weight = grad_weight.to(weight.dtype)
    return loss * scale, grad_h, grad_weight
