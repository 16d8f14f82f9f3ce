"""gpt-oss's attention sinks: a learned logit per query head in each softmax denominator,
weights exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h)). fp64 against the softmax written out with
the sink as one more column (1e-10), on sdpa (values and gradients, sinks' included) and flex
(forward: torch has no FlexAttention backward on CPU), with a sliding window and documents, and
under context parallelism (allgather, two thread ranks); the other CP backends refuse sinks."""

import pytest
import torch

from titan_lightning.models.common.masking import Documents, attend, block_causal_mask, documents_for
from titan_lightning.parallel.context import ContextParallel, context_parallel_attention

from tests.decoders import reference_attention

S, H, KV, D = 16, 4, 2, 8
LENGTHS = [[5, 1, 6, 4], [S]]


def _positions(lengths):
    return torch.tensor([[p for n in row for p in range(n)] for row in lengths])


def _inputs(grad: bool):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, S, h, D, generator=g, dtype=torch.float64) for h in (H, KV, KV))
    sinks = torch.randn(H, generator=g, dtype=torch.float64) * 2
    return [t.requires_grad_(grad) for t in (q, k, v, sinks)]


class _Args:  # what documents_for reads
    def __init__(self, kernel, mask, window):
        self.attention, self.mask, self.positions, self.max_seq_len = kernel, mask, "global", S
        self.sliding_window, self.layer_types = window, None


def _ids(lengths):
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])


@pytest.mark.parametrize("kernel, mask", [("sdpa", "causal"), ("sdpa", "block_causal"), ("flex", "block_causal")])
def test_sinks_equal_the_softmax_with_a_sink_column(kernel, mask):
    grad = kernel == "sdpa"
    q, k, v, sinks = _inputs(grad)
    ids = _ids(LENGTHS) if mask == "block_causal" else None
    for window in (None, 3):
        documents = documents_for(_Args(kernel, mask, window), _positions(LENGTHS), q)
        out = attend(q, k, v, documents, window=window, sinks=sinks)
        expected = reference_attention(q, k, v, window, ids, sinks=sinks)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
        assert (out - attend(q, k, v, documents, window=window)).abs().max() > 1e-2  # the sinks count
        if grad:
            w = torch.randn_like(out)
            for name, a, b in zip("qkvs", torch.autograd.grad((out * w).sum(), (q, k, v, sinks)),
                                  torch.autograd.grad((expected * w).sum(), (q, k, v, sinks))):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"d{name}, window {window}")


def test_sinks_without_documents_on_sdpa():
    q, k, v, sinks = _inputs(False)
    expected = reference_attention(q, k, v, sinks=sinks)
    torch.testing.assert_close(attend(q, k, v, None, sinks=sinks), expected, rtol=0, atol=1e-10)


def _cp_sinks(rank: int, world_size: int, *, window, lengths) -> dict:
    """This rank's allgather attention with sinks (and its q/k/v/sink gradients) against the reference."""
    import torch.distributed as dist

    q, k, v, sinks = _inputs(False)
    ids = None if lengths is None else _ids(lengths)
    expected = reference_attention(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), window, ids,
                                   sinks=sinks.requires_grad_())
    w = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((expected * w).sum(), (q, k, v, sinks))
    cp = ContextParallel(group=dist.group.WORLD, rank=rank, size=world_size, load_balancer="headtail")
    local = [cp.shard(t.detach()).requires_grad_() for t in (q, k, v)]
    mine = sinks.detach().clone().requires_grad_()
    documents = None
    if lengths is not None:
        documents = Documents(cp.shard(_positions(lengths)), block_causal=True, per_document=False,
                              mask=block_causal_mask(_positions(lengths)))
    out = context_parallel_attention(*local, cp, "allgather", documents, window, sinks=mine)
    (out * cp.shard(w)).sum().backward()
    errors = {"out": (out - cp.shard(expected)).abs().max().item()}
    errors.update({f"d{n}": (t.grad - cp.shard(g)).abs().max().item() for n, t, g in zip("qkv", local, grads)})
    errors["sink_grad"] = mine.grad  # summed over the ranks by the caller
    errors["expected_sink_grad"] = grads[3]
    return errors


@pytest.mark.parametrize("window, lengths", [(None, None), (3, None), (5, LENGTHS)],
                         ids=["causal", "window", "window-block_causal"])
def test_cp_allgather_computes_the_sinks_exactly(window, lengths):
    from titan_lightning.testing.threaded import run_threaded

    results = run_threaded(_cp_sinks, 2, window=window, lengths=lengths)
    for errors in results:
        assert all(errors[name] < 1e-10 for name in ("out", "dq", "dk", "dv")), errors
    # Each rank's sink gradient covers its queries; together they are the whole one.
    total = sum(r["sink_grad"] for r in results)
    torch.testing.assert_close(total, results[0]["expected_sink_grad"], rtol=0, atol=1e-10)


@pytest.mark.parametrize("backend", ["ring", "ulysses"])
def test_the_other_cp_backends_refuse_sinks(backend):
    q, k, v, sinks = _inputs(False)
    with pytest.raises(ValueError, match=f"backend '{backend}' has no attention sinks; use allgather"):
        context_parallel_attention(q, k, v, None, backend, sinks=sinks)


def test_varlen_refuses_sinks():
    q, k, v, sinks = _inputs(False)
    with pytest.raises(ValueError, match="model.attention='varlen' has no attention sinks"):
        attend(q, k, v, Documents(None, False, False, kernel="varlen"), sinks=sinks)
