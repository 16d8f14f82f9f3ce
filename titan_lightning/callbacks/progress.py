"""Lightning's progress bars, their training bar counting steps: "Epoch 0, step 3/10" for a run
limited by steps (Lightning's own says "Epoch 0/-2"), "Epoch 0/2, step 3/30" for one by epochs,
and a total that a resumed run, one accumulating gradients, or a last epoch cut short by
``max_steps`` does not run past."""

from typing import Any, Union

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf


def train_description(trainer: L.Trainer) -> str:
    """"Epoch 0/2, step 3/30" for a run by epochs (the last epoch's index, as Lightning writes it); a
    run limited by steps (max_epochs=-1, which Lightning's RichProgressBar would print as "Epoch
    0/-2") counts its steps only: "Epoch 0, step 3/10"."""
    description = f"Epoch {trainer.current_epoch}"
    if trainer.max_epochs is not None and trainer.max_epochs >= 0:
        description = f"{description}/{trainer.max_epochs - 1}"
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return f"{description}, step {trainer.global_step}/{trainer.max_steps}"
    return description


def _batches_done(trainer: L.Trainer) -> int:
    """Batches of this epoch already trained when it starts: 0, or where a resumed run continues
    (Lightning resets the count after the epoch has started: a whole epoch's count is the last one's)."""
    processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return processed if processed < trainer.num_training_batches else 0


def train_total(trainer: L.Trainer) -> Union[int, float]:
    """The training bar's total, in batches of this epoch: the epoch's batches (a run by epochs:
    the length of its train loader), or fewer where ``max_steps`` ends the run first: the batches
    done (a resumed run's bar continues from them) plus the rest of ``max_steps`` times the batches
    per optimizer step. Lightning's own counts the remaining optimizer steps only, so a resumed
    run's bar (and one accumulating gradients) ran past its total and tqdm dropped it ("33/?")."""
    batches = trainer.num_training_batches
    if trainer.max_steps is not None and trainer.max_steps > 0:
        remaining = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
        return min(batches, _batches_done(trainer) + remaining)
    return batches


class StepProgressBar(TQDMProgressBar):
    """Lightning's progress bar, its training bar described by ``train_description``."""

    @property
    def total_train_batches(self) -> Union[int, float]:
        return train_total(self.trainer)

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self._start(trainer, _batches_done(trainer))  # a run resumed inside an epoch gets no on_train_epoch_start

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._start(trainer, 0)  # (the epoch's batch count is reset after this hook)

    def _start(self, trainer: L.Trainer, done: int) -> None:
        bar = self.train_progress_bar
        bar.total = convert_inf(self.total_train_batches)
        bar.initial = bar.n = done  # (its rate counts this run's batches only)
        bar.set_description(train_description(trainer))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_description(train_description(trainer), refresh=False)
        super().on_train_batch_end(trainer, *args)


class StepRichProgressBar(RichProgressBar):
    """Lightning's RichProgressBar, its training bar described by ``train_description``."""

    @property
    def total_train_batches(self) -> Union[int, float]:
        return train_total(self.trainer)

    def _get_train_description(self, current_epoch: int) -> str:  # Lightning's only hook for it
        return f"{train_description(self.trainer):{len(self.validation_description)}}"
