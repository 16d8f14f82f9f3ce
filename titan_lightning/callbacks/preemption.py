"""Preemption: SIGTERM (SLURM's preemption and time limit, spot instances, Kubernetes) saves a
checkpoint at the end of the current optimizer step and ends fit cleanly.

Rerun the same command with ``--job.checkpoint.resume_from latest`` and training continues from
that step exactly as if it had never stopped. The signal handler only sets a flag; at the end of
each optimizer step every rank learns whether any rank got the signal (one host-side all-reduce
on a gloo group of its own), so all ranks stop after the same step. Lightning's own SIGTERM
handler (which stops without a checkpoint) is replaced while training runs.
"""

import logging
import signal
import threading
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import torch
import torch.distributed as dist

from titan_lightning._compat import mark_checkpoint_saved
from titan_lightning.steps import ends_optimizer_step

log = logging.getLogger(__name__)


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, save ``epoch=E-step=S.ckpt`` next to the run's checkpoints and stop after this step."""

    def __init__(self) -> None:
        self.preempted: Optional[Path] = None  # the checkpoint written when the run was preempted
        self._received = False
        self._previous: Any = None
        self._group: Any = None
        self._collective = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._received, self.preempted = False, None
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._collective = distributed and dist.get_backend() != "fake"
        if self._collective and self._group is None:
            self._group = dist.new_group(backend="gloo")  # every rank, here: a new group is a collective
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self._received = True  # only a flag: the step in flight finishes, its collectives intact

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not ends_optimizer_step(trainer, batch_idx) or not self._anyone_received():
            return
        folder = Path(trainer.checkpoint_callback.dirpath) if trainer.checkpoint_callback is not None and \
            trainer.checkpoint_callback.dirpath else Path(trainer.default_root_dir) / "checkpoints"
        path = folder / f"epoch={trainer.current_epoch}-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)
        self.preempted = path
        _saved_at_this_step(trainer)
        trainer.should_stop = True
        if trainer.is_global_zero:
            log.info(f"titan-lightning: SIGTERM: stopped after step {trainer.global_step}, checkpoint {path}; rerun "
                     f"with --job.checkpoint.resume_from latest to continue")

    def _anyone_received(self) -> bool:
        if not self._collective:
            return self._received
        flag = torch.tensor([int(self._received)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
        self._previous = None
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None


def _saved_at_this_step(trainer: L.Trainer) -> None:
    """Tell the run's ModelCheckpoints that this step is saved, so none writes a second checkpoint of
    it when fit ends (``epoch=0-step=S-v1.ckpt``: the validation that ends a stopped run saves again).
    That second one would also be what ``latest`` picks, and Lightning restores its logger step one
    too low (a checkpoint saved at validation end after the last batch). ``_last_global_step_saved``
    is the attribute ModelCheckpoint itself reads to skip a step it already saved."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            mark_checkpoint_saved(callback, trainer.global_step)
