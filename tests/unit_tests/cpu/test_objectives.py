"""A step's objective (titan_lightning/objectives/) and the seams the pipeline and the estimator use
instead of replacing code: the module's ``model_input``, and parallel/value_free.py's assumptions.
The objectives on every layout: test_sft_loss.py, the llama3_pp2* and llama3_sft_* suite entries."""

import pytest
import torch
import torch.nn.functional as F

from recipes.tests import features
from titan_lightning.models.common import moe
from titan_lightning.models.common.loss import IGNORE_INDEX
from titan_lightning.objectives import MicrobatchTokenMean, StepTokenMean
from titan_lightning.parallel import value_free

VOCAB, DIM = 11, 8


def token_loss(output: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction)


def microbatches(supervised: list[int], seq: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(hidden states [1, seq, DIM], labels [1, seq]) with the first ``n`` labels supervised."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n in supervised:
        labels = torch.randint(0, VOCAB, (1, seq), generator=g)
        labels[:, n:] = IGNORE_INDEX
        out.append((torch.randn(1, seq, DIM, generator=g), labels))
    return out


def test_the_step_token_mean_weighs_microbatches_by_their_supervised_tokens():
    """Two accumulated microbatches of 2 and 10 supervised tokens, each backward weighted 1/2 as the
    strategy weighs any loss: after end_step the gradients and the loss are those of the mean over
    the 12 tokens at once, not the mean of the two means."""
    weight = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
    batches = microbatches([2, 10])
    h, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    want = token_loss(h @ weight.T, labels, "mean")
    (want_grad,) = torch.autograd.grad(want, weight)

    objective = StepTokenMean(token_loss)
    for h, labels in batches:
        loss, records = objective.loss(h @ weight.T, {"labels": labels})
        assert records == []  # logged once, at the step's end
        (loss / len(batches)).backward()
    end = objective.end_step([weight.grad], torch.device("cpu"), None)
    torch.testing.assert_close(weight.grad, want_grad)
    torch.testing.assert_close(end.losses[0], want.detach())
    assert end.tokens.item() == 12
    assert {name: value.item() for name, value, _ in end.records}["train/supervised_tokens"] == 12
    mean_of_means = sum(token_loss(h @ weight.T, labels, "mean") for h, labels in batches) / 2
    assert abs(mean_of_means.item() - want.item()) > 1e-3  # (what the weighting corrects)


def test_the_microbatch_token_mean_logs_each_loss_and_hands_the_step_its_losses_once():
    weight = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(1))
    objective = MicrobatchTokenMean(token_loss)
    losses = []
    for h, labels in microbatches([3, 7]):
        loss, records = objective.loss(h @ weight.T, {"labels": labels})
        torch.testing.assert_close(loss, token_loss(h @ weight.T, labels, "mean"))
        assert records == [("train/loss", loss, {"sync_dist": True})]
        losses.append(loss)
    assert objective.end_step([], torch.device("cpu"), None).losses == losses
    assert objective.end_step([], torch.device("cpu"), None).losses == []  # the next step starts empty


def test_eval_loss_weighs_a_batch_by_its_labelled_tokens_and_a_filler_adds_nothing():
    weight = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(1))
    (h, labels), = microbatches([5])
    mean, tokens = MicrobatchTokenMean(token_loss).eval_loss(h @ weight.T, {"labels": labels})
    torch.testing.assert_close(mean, token_loss(h @ weight.T, labels, "mean"))
    assert tokens.item() == 5
    assert StepTokenMean(token_loss).eval_loss(h @ weight.T, {"labels": torch.full_like(labels, IGNORE_INDEX)})[1] == 0


@pytest.mark.parametrize("mask, positions, takes_positions", [
    ("causal", "global", False), ("block_causal", "per_document", True), ("causal", "per_document", True),
])
def test_the_model_input_carries_document_boundaries_only_where_the_model_reads_them(mask, positions, takes_positions):
    """What the first pipeline stage is fed: CausalLMModule.model_input."""
    run = features.llama3_small()
    run.job.model.mask, run.job.model.positions = mask, positions
    ids, position_ids = torch.zeros(2, 8, dtype=torch.long), torch.arange(8).repeat(2, 1)
    args, kwargs = run.module.model_input({"input_ids": ids, "labels": ids, "position_ids": position_ids})
    assert args[0] is ids and kwargs == {}
    assert (len(args) == 2 and args[1] is position_ids) if takes_positions else len(args) == 1
    offsets = (torch.tensor([0, 8, 16]), 8)  # the document offsets prepare_batch_on_host adds for varlen
    batch = {"input_ids": ids, "position_ids": position_ids, "cu_seqlens": offsets[0], "max_seqlen": offsets[1]}
    assert run.module.model_input(batch)[1] == {"varlen_offsets": offsets}


def test_value_free_assumptions_hold_inside_the_block_only():
    """Where the model reads values (MoE token counts, the grouped GEMM's choice), the estimator's
    assumptions replace them inside ``assuming`` and nowhere else."""
    experts = torch.tensor([[0, 2], [2, 1]])
    assumptions = value_free.Assumptions(count_tokens=lambda e, n: torch.full((n,), 7), grouped_mm=lambda x: True,
                                         ep_splits=lambda ep, counts: ([], [], counts), lower_right_mask=False)
    cpu_tokens = torch.zeros(1, 16)  # fp32 on the CPU: never the automatic grouped GEMM in a run
    with value_free.assuming(assumptions):
        assert value_free.assumed() is assumptions
        assert moe.routed_counts(experts, 4).tolist() == [7, 7, 7, 7]
        assert moe.grouped_mm_available(cpu_tokens)
    assert value_free.assumed() is None
    assert moe.routed_counts(experts, 4).tolist() == [1, 1, 2, 0]
    assert not moe.grouped_mm_available(cpu_tokens)


def test_the_pipeline_splits_a_step_at_the_model_call_unless_a_subclass_changed_the_hook():
    """The last pipeline stage runs CausalLMModule's step_from_output on its output; a subclass whose
    training_step is its own gets that training_step run instead (its model answering the output)."""
    from titan_lightning.strategies.pipeline import _offers_steps

    module = features.llama3_small().module

    class OwnStep(type(module)):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * 2

    own = OwnStep(module.job)
    assert [_offers_steps(module, hook) for hook in ("training_step", "validation_step")] == [True, True]
    assert [_offers_steps(own, hook) for hook in ("training_step", "validation_step")] == [False, True]
    assert not _offers_steps(torch.nn.Module(), "training_step")  # a module of one's own
