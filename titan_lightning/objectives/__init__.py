"""What a training step optimizes, in one object that the LightningModule (models/causal_lm.py),
the pipeline's last stage (strategies/pipeline.py) and the memory estimator (estimate.py) all call:
a new objective is written once, as another subclass of ``Objective``.

    base.py        ``Objective``: the three calls of a step below; ``StepEnd``, what the second returns
    next_token.py  next-token cross entropy: ``MicrobatchTokenMean`` (the mean over each microbatch's
                   labelled tokens, pretraining) and ``StepTokenMean`` (``data.sft``: the sum over the
                   supervised tokens divided by the supervised tokens of the whole optimizer step)
    preference.py  preference losses on chosen / rejected pairs (DPO, IPO, SimPO) and their metrics

A step, on every layout:

    objective.loss(output, batch)       each microbatch: the loss backward runs on (the strategy
                                        weighs it 1 / microbatches, as any loss) and what to log
    objective.end_step(grads, device, mesh)
                                        once, after the step's last backward and before clipping,
                                        on every rank (pipeline stages without the loss too): the
                                        step's reductions (all-reduces, gradients rescaled in
                                        place), the losses checked for finiteness, what to log
    objective.eval_loss(output, batch)  validation and test: (mean loss, weight) for the metric

``output`` is what the module's ``loss_input`` returned for the batch: logits, or with
``training.loss_chunks`` the final norm's hidden states. An objective reaches the cross entropy
only through ``token_loss(output, labels, reduction[, rows])`` (mean, sum, or "none": each token's, 0
where unlabelled), which the module gives it: the compiled loss, or the head's chunked one, full logits
never held; ``Objective.batch_loss(output, batch, reduction)`` calls it with the batch's labels (and
its ``label_rows``, when the host found them: the output then holds those rows alone).
``CausalLMModule.build_objective`` picks the objective of a job.
"""

from titan_lightning.objectives.base import Objective, Record, StepEnd, TokenLoss
from titan_lightning.objectives.next_token import MicrobatchTokenMean, StepTokenMean

__all__ = ["MicrobatchTokenMean", "Objective", "Record", "StepEnd", "StepTokenMean", "TokenLoss"]
