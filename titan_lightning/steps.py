"""Where an optimizer step begins and ends within Lightning's training batches.

Lightning's training epoch loop steps the optimizer after every ``accumulate_grad_batches``
batches and, unless the strategy accumulates across epochs itself, after an epoch's last
batch. Every callback and the strategy ask these two functions, so they all agree with it.
"""

import lightning as L


def ends_optimizer_step(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether the optimizer steps after batch ``batch_idx`` of the current training epoch."""
    if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
        return True
    if trainer.strategy.handles_gradient_accumulation:
        return False
    last = batch_idx + 1 == trainer.num_training_batches
    return last or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


def starts_optimizer_step(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether batch ``batch_idx`` is the first of an optimizer step (the epoch's first batch always is)."""
    return batch_idx % trainer.accumulate_grad_batches == 0
