"""Next-token cross entropy: the mean over each microbatch's labelled tokens (pretraining), or the
mean over the supervised tokens of the whole optimizer step (loss-masked fine-tuning, ``data.sft``)."""

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from titan_lightning.models.common.loss import IGNORE_INDEX
from titan_lightning.objectives.base import Objective, Record, StepEnd, local


class MicrobatchTokenMean(Objective):
    """The mean cross entropy over each microbatch's labelled tokens; the step's loss is the mean
    of its microbatches' (gradient accumulation and the data-parallel reduction average them)."""

    label_rows = True

    def loss(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[Record]]:
        loss = self.batch_loss(output, batch, "mean")
        value = local(loss).detach()
        # Checked for finiteness with the grad norm, one step later (the module's clipping): a
        # check here would synchronize with the device between forward and backward on every step.
        self.keep(value)
        return loss, [("train/loss", value, {"sync_dist": True})]


class StepTokenMean(Objective):
    """The sum of the cross entropies over the supervised tokens divided by the supervised tokens of
    the whole optimizer step (all microbatches, data-parallel and context-parallel ranks): where
    microbatches hold different numbers of supervised tokens, a mean per microbatch or per rank
    would weigh them wrongly. Each microbatch's loss is its sum; ``end_step`` rescales the step's
    gradients once every microbatch ran."""

    label_rows = True

    def __init__(self, token_loss) -> None:
        super().__init__(token_loss)
        # This step's microbatch (supervised tokens, loss sum), fp64.
        self._sums: list[torch.Tensor] = []

    def loss(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[Record]]:
        loss = self.batch_loss(output, batch, "sum")
        supervised = (batch["labels"] != IGNORE_INDEX).sum()
        self._sums.append(torch.stack([supervised.double(), local(loss).detach().double()]))
        return loss, []

    def end_step(self, grads: list[torch.Tensor], device: torch.device, mesh: Any) -> StepEnd:
        """Make the step's gradients those of (sum of the per-token losses over the step's supervised
        tokens) / (their number), on every layout.

        Each microbatch's backward ran on its loss sum, weighted as the strategy weighs any loss: 1 /
        (microbatches on the rank) by gradient accumulation and pipeline microbatches, then averaged
        over the data-parallel (and context-parallel) ranks by the gradient reduction. So the
        gradients hold sum / K, K = the microbatch losses of the step over all those ranks, and
        multiplying them by K / N (N = supervised tokens of the step) gives sum / N. K, N and the
        loss sum come from one all-reduce over every rank: ranks that hold the same tokens (TP,
        pipeline stages other than the last, which contribute nothing) scale K and N alike.
        """
        sums, self._sums = self._sums, []
        device = grads[0].device if grads else device
        totals = step_totals(sums, 3, device)
        microbatches, tokens, loss_sum = totals.unbind()
        scale_grads_(grads, microbatches / tokens.clamp(min=1.0))
        loss = (loss_sum / tokens.clamp(min=1.0)).float()
        records = [("train/loss", loss, {}), ("train/supervised_tokens", tokens.float() / label_copies(mesh), {})]
        return StepEnd([loss], tokens, records)


def step_totals(sums: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    """[the number of ``sums``, then their sum]: ``width`` fp64 values on ``device``, summed over every
    rank. Made on the device: an element set from the host is a synchronizing copy (the host would
    wait mid-step for the backward)."""
    if sums:
        summed = torch.stack(sums).sum(0).to(device)
        totals = torch.cat([summed.new_full((1,), float(len(sums))), summed])
    else:
        totals = torch.zeros(width, dtype=torch.float64, device=device)
    sum_over_ranks(totals)
    return totals


def sum_over_ranks(totals: torch.Tensor) -> None:
    """``totals`` summed in place over every rank of the run (unchanged in one process)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals)


def scale_grads_(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply each gradient (its local shard) by ``factor`` in place: one multi-tensor kernel per
    dtype and device, not two kernels per parameter (~700 launches a step on a 28-layer model);
    the same products, bitwise."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for grad in grads:
        local_grad = grad.to_local() if isinstance(grad, DTensor) else grad
        groups.setdefault((local_grad.dtype, local_grad.device), []).append(local_grad)
    for (dtype, grad_device), group in groups.items():
        torch._foreach_mul_(group, factor.to(device=grad_device, dtype=dtype))


def label_copies(mesh: Any) -> int:
    """How many ranks hold each label: the tensor-parallel ones hold the same (context-parallel
    ranks hold slices, pipeline stages before the last none)."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return next((mesh[name].size() for name in ("tp", "tensor_parallel") if name in names), 1)
