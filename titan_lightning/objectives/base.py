"""The seam every objective fills: a microbatch's loss, the step's end, the evaluation loss."""

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import torch
from torch.distributed.tensor import DTensor

from titan_lightning.models.common.loss import IGNORE_INDEX

# (name, value, options): a ``LightningModule.log`` call, made by the module (or, under pipeline
# parallelism, recorded on the last stage and replayed on every rank: strategies/logs.py).
Record = tuple[str, Any, dict]
# (what the model returned, labels, reduction: "mean" | "sum" | "none") -> the cross entropy.
TokenLoss = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]
# A batch's key for its labelled rows, when the host found them (CausalLMModule.prepare_batch_on_host).
LABEL_ROWS = "label_rows"


@dataclass
class StepEnd:
    """What ``Objective.end_step`` hands back to the module's clipping.

    ``losses``: this rank's values checked for finiteness with the grad norm, one step later (their
    mean is the progress bar's ``loss``); ``tokens``: the step's supervised tokens over every rank,
    when the objective counts them (0 stops the run: nothing to learn from); ``records``: what to log."""

    losses: list[torch.Tensor]
    tokens: Optional[torch.Tensor] = None
    records: list[Record] = field(default_factory=list)


class Objective:
    """What a training step optimizes, given the model's output and the batch (the package
    docstring: the calls of a step). A subclass writes ``loss``; ``end_step`` by default hands
    back the microbatch losses that ``loss`` kept with ``keep``."""

    # Whether the model may compute the logits of a batch's labelled rows alone (the host's
    # ``label_rows``): this objective reaches the cross entropy through ``batch_loss``. A subclass
    # that overrides ``loss`` or ``eval_loss`` is taken to call ``token_loss`` with whole labels,
    # unless it sets this itself.
    label_rows: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "label_rows" not in cls.__dict__ and {"loss", "eval_loss"} & set(cls.__dict__):
            cls.label_rows = False

    def __init__(self, token_loss: TokenLoss) -> None:
        self.token_loss = token_loss
        self._losses: list[torch.Tensor] = []

    def batch_loss(self, output: torch.Tensor, batch: dict[str, torch.Tensor], reduction: str) -> torch.Tensor:
        """``token_loss`` of ``output`` against the batch's labels; over the labelled rows alone when
        the host found them (``label_rows``: the model computed logits for those alone)."""
        rows = batch.get(LABEL_ROWS)
        return self.token_loss(output, batch["labels"], reduction, *(() if rows is None else (rows,)))

    def loss(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[Record]]:
        """This microbatch's loss, which backward runs on, and what to log."""
        raise NotImplementedError

    def keep(self, loss: torch.Tensor) -> None:
        """Keep a microbatch's loss value (detached) for the step's finiteness check."""
        self._losses.append(loss)

    def end_step(self, grads: list[torch.Tensor], device: torch.device, mesh: Any) -> StepEnd:
        """After the step's last backward, on every rank: the step's reductions over ``mesh`` (grads
        changed in place), then what the module checks and logs."""
        losses, self._losses = self._losses, []
        return StepEnd(losses)

    def eval_loss(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mean cross entropy over the batch's labelled tokens, their number): the validation
        metric weighs each batch by its tokens, so it is the mean over every held-out token (a
        filler batch, all labels ignored, adds nothing)."""
        loss_sum = local(self.batch_loss(output, batch, "sum"))
        tokens = (batch["labels"] != IGNORE_INDEX).sum()
        return loss_sum / tokens.clamp(min=1), tokens


    def eval_records(self, prefix: str, loss: torch.Tensor, mesh: Any) -> list[Record]:
        """What is logged with the held-out ``loss`` (already the same on every rank) at the end of a
        validation or test: its perplexity. On every rank (an objective may reduce over ``mesh``)."""
        return [(f"{prefix}/ppl", torch.exp(loss), {"sync_dist": True, "reduce_fx": "max"})]


def local(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (loss parallel's replicated DTensor: its full value)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
