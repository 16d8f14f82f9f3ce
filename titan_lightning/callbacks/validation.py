"""Validation after a run's last step, for a run that validates every N steps."""

from typing import Any

import lightning as L


class FinalValidation(L.Callback):
    """A run that validates every ``val_check_interval`` batches counted over the whole run
    (an int interval with ``check_val_every_n_epoch`` None, as a run by epochs gets from its data
    module) also validates after its last step, so that its last ``val/loss`` is the trained
    model's. Lightning validates then only when the step count is a multiple of the interval; it
    validates whenever the run is asked to stop, so the last step asks (``should_stop``: the run
    ends there anyway, at ``max_steps``)."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        every_n_steps = isinstance(trainer.val_check_interval, int) and trainer.check_val_every_n_epoch is None
        if every_n_steps and trainer.limit_val_batches != 0 and 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True
