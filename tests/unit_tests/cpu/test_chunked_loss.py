"""training.loss_chunks: the head and the cross entropy over chunks of the tokens, never holding full
logits, equal to the plain loss and its gradients (multi-rank: the features suite's
llama3_fsdp2_tp2_chunked_loss and llama3_pp2_chunked_loss against the plain one-process run)."""

import pytest
import torch
import torch.nn.functional as F
from test_estimate import debug_run, measured_peak

from recipes.tests import features
from titan_lightning.config import ConfigError, TrainingConfig
from titan_lightning.estimate import estimate
from titan_lightning.models.causal_lm import IGNORE_INDEX, cross_entropy_loss
from titan_lightning.models.common.decoder import Head
from titan_lightning.models.common.loss import linear_cross_entropy

B, S, D, V = 2, 37, 16, 50  # 74 tokens: no chunk count below divides them but 1, 2 and 37


def inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, S, D, generator=g, dtype=dtype, requires_grad=True)
    w = (0.3 * torch.randn(V, D, generator=g, dtype=dtype)).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :5] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX
    return h, w, labels


def loss_and_grads(loss_fn, h, w):
    loss = loss_fn()
    return (loss, *torch.autograd.grad(loss, (h, w)))


@pytest.mark.parametrize("chunks", [1, 3, 8, 74, 100])
def test_chunked_loss_equals_the_plain_loss_and_its_gradients(chunks):
    h, w, labels = inputs()
    plain = loss_and_grads(lambda: cross_entropy_loss(h @ w.T, labels), h, w)
    chunked = loss_and_grads(lambda: linear_cross_entropy(h, w, labels, chunks=chunks), h, w)
    assert chunked[0].dtype == torch.float32 and chunked[0].dim() == 0
    for got, want in zip(chunked, plain):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_incoming_gradient_scales_both_gradients():
    h, w, labels = inputs()
    plain = loss_and_grads(lambda: 0.25 * cross_entropy_loss(h @ w.T, labels), h, w)
    chunked = loss_and_grads(lambda: 0.25 * linear_cross_entropy(h, w, labels, chunks=3), h, w)
    for got, want in zip(chunked, plain):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_without_gradients_only_the_loss_is_computed():
    h, w, labels = inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, labels, chunks=3)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, cross_entropy_loss(h @ w.T, labels).detach(), rtol=1e-6, atol=1e-6)


def test_every_label_ignored_gives_nan_as_the_plain_loss_does():
    h, w, labels = inputs()
    labels.fill_(IGNORE_INDEX)
    assert torch.isnan(linear_cross_entropy(h, w, labels, chunks=3))
    assert torch.isnan(cross_entropy_loss(h @ w.T, labels))


def test_under_bf16_autocast_the_matmuls_run_in_bf16_as_the_plain_head_does():
    h, w, labels = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = cross_entropy_loss(F.linear(h, w), labels)
        chunked = linear_cross_entropy(h, w, labels, chunks=3)
    # the same bf16 logits, so the same fp32 loss; fp32 would differ from both by ~1e-3
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    assert abs(chunked.item() - cross_entropy_loss(h @ w.T, labels).item()) > 1e-5
    grads = torch.autograd.grad(chunked, (h, w))
    assert [g.dtype for g in grads] == [torch.float32, torch.float32]  # the parameters' dtype


def test_bf16_parameters_get_bf16_gradients():
    h, w, labels = inputs(torch.bfloat16)
    grads = torch.autograd.grad(linear_cross_entropy(h, w, labels, chunks=3), (h, w))
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.bfloat16]


def test_the_head_gives_logits_without_labels_and_the_loss_with_them():
    h, w, labels = inputs()
    head = Head(D, V)
    with torch.no_grad():
        head.weight.copy_(w)
    assert torch.equal(head(h), F.linear(h, head.weight))
    torch.testing.assert_close(head(h, labels=labels, chunks=3), cross_entropy_loss(head(h), labels),
                               rtol=1e-6, atol=1e-6)


def test_the_module_with_loss_chunks_trains_as_the_plain_one():
    """One process, 2 steps of the small model: the loss the module logs and the weights after."""

    def train(chunks):
        run = features.llama3_small()
        run.job.training.loss_chunks = chunks
        module = run.module
        module.model = module.build_model().to_empty(device="cpu")
        module.model.init_weights(0)
        optimizer = torch.optim.SGD(module.model.parameters(), lr=0.5)
        tokens = torch.randint(0, run.job.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
        losses = []
        for _ in range(2):
            loss = module.loss_fn(module.loss_input(tokens), tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, module.model.output.weight.detach()

    (plain, w_plain), (chunked, w_chunked) = train(None), train(5)
    assert chunked == pytest.approx(plain, rel=1e-6)
    torch.testing.assert_close(w_chunked, w_plain, rtol=1e-5, atol=1e-6)


def test_the_estimate_drops_the_full_logits_and_matches_the_measured_peak():
    small = dict(seq_len=128, tokens_per_microbatch_per_dp_rank=512)
    plain = estimate(debug_run(**small), 1)
    chunked_run = debug_run(loss_chunks=4, **small)
    chunked = estimate(chunked_run, 1)
    logits = 512 * chunked_run.job.model.vocab_size * 4  # one fp32 copy of the logits
    assert chunked.static == plain.static
    assert plain.peak - chunked.peak > 1.5 * logits
    assert abs(chunked.peak - measured_peak(debug_run(loss_chunks=4, **small))) <= 0.1 * chunked.peak


@pytest.mark.parametrize("value", [0, -2, True, 1.5])
def test_loss_chunks_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match=rf"training.loss_chunks={value!r} must be a positive integer"):
        TrainingConfig(loss_chunks=value)


def test_a_model_whose_loss_cannot_apply_the_head_is_refused():
    run = features.llama3_small()
    run.job.training.loss_chunks = 2
    module = run.module
    module.build_model = lambda: torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="training.loss_chunks=2 needs a model whose loss applies its head"):
        module.configure_model()


def test_the_module_still_returns_logits_with_loss_chunks():
    """Only the loss takes hidden states: ``module(tokens)`` gives the logits either way."""
    logits = {}
    for chunks in (None, 3):
        run = features.llama3_small()
        run.job.training.loss_chunks = chunks
        module = run.module
        module.model = module.build_model().to_empty(device="cpu")
        module.model.init_weights(0)
        tokens = torch.randint(0, run.job.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits[chunks] = module(tokens)
    assert logits[3].shape == (2, 16, run.job.model.vocab_size)
    torch.testing.assert_close(logits[3], logits[None], rtol=0, atol=0)
