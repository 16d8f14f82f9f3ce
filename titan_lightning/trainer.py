"""How a run becomes a Trainer: ``build_trainer`` validates the run and adds what a job asks for
(its strategy, precision, loggers, checkpoints, metrics, weights in and out, profiling, our
progress bar) into ``<root>/<name>/<timestamp>``. Nothing is written and nothing is spawned."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from titan_lightning import device_defaults
from titan_lightning.callbacks import TrainingMetrics
from titan_lightning.callbacks.metrics import SourceTokens
from titan_lightning.callbacks.preemption import PreemptionCheckpoint
from titan_lightning.callbacks.profiling import ProfileSteps
from titan_lightning.callbacks.progress import StepProgressBar, StepRichProgressBar
from titan_lightning.callbacks.validation import FinalValidation
from titan_lightning.callbacks.weights import ExportWeights, LoadWeights
from titan_lightning.config import JobConfig, validate_job
from titan_lightning.config.validation import (
    TRAINER_ARGS_SET_BY_JOB,
    apply_precision,
    gradient_accumulation_steps,
    validate_trainer_args,
    validate_vocab,
)
from titan_lightning.run import Run
from titan_lightning.strategies import TitanStrategy


RUN_DIR_ENV = "TITAN_LIGHTNING_RUN_DIR"
RUN_CONFIG = "config.yaml"  # a run's options in its folder, for generate / chat on its checkpoints


class RunConfig(L.Callback):
    """At the start of fit (rank 0): ``<run folder>/config.yaml``, the run as --print_config prints
    it (``text``), written whole (a temporary file renamed)."""

    def __init__(self, folder: Path, text: str) -> None:
        self.folder, self.text = folder, text

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / f".{RUN_CONFIG}.{os.getpid()}"
        partial.write_text(self.text)
        os.replace(partial, self.folder / RUN_CONFIG)


def run_dir(run: Run, root: Optional[str]) -> Path:
    """The folder this run writes into: ``<root>/<name>/<timestamp>``, shared by all ranks."""
    if RUN_DIR_ENV not in os.environ:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        os.environ[RUN_DIR_ENV] = str(Path(root or "runs") / run.name / stamp)
    return Path(os.environ[RUN_DIR_ENV])


def _validate_vocab(run: Run, job: JobConfig) -> None:
    tokenizer = getattr(run.datamodule, "tokenizer", None)
    if tokenizer is not None:
        validate_vocab(job, tokenizer.vocab_size)


def checkpoint_callback(job: Optional[JobConfig], folder: Path) -> ModelCheckpoint:
    """Lightning's ModelCheckpoint as ``job.checkpoint`` asks: every ``interval`` steps, the newest
    ``keep_latest_k`` kept (ranked by step), into ``<run folder>/checkpoints``."""
    if job is None:
        return ModelCheckpoint(dirpath=folder / "checkpoints")
    c = job.checkpoint
    keep = {"save_top_k": c.keep_latest_k, "monitor": "step", "mode": "max"} if c.keep_latest_k != -1 else {"save_top_k": -1}
    if c.interval is None and c.keep_latest_k == -1:
        keep = {}  # Lightning's default: the newest checkpoint after each validation
    return ModelCheckpoint(dirpath=folder / "checkpoints", every_n_train_steps=c.interval, **keep)


def _progress_bar(callbacks: list) -> list:
    """Ours unless the run brings its own; Lightning's RichProgressBar becomes ours, settings kept."""
    for bar in callbacks:
        if type(bar) is RichProgressBar:
            bar.__class__ = StepRichProgressBar  # adds one method, no state
    if any(isinstance(c, ProgressBar) for c in callbacks):
        return callbacks
    return [*callbacks, StepProgressBar()]


def build_trainer(run: Run) -> L.Trainer:
    """Validate the run and build its Trainer. Nothing is written and nothing is spawned."""
    kwargs = dict(run.trainer)
    job = run.job
    if job is not None:
        validate_trainer_args(kwargs)
        for key in TRAINER_ARGS_SET_BY_JOB:
            kwargs.pop(key, None)
        kwargs["deterministic"] = job.training.deterministic or None
        # (trainer.precision becomes the job's dtypes; fp32 reduce stays as the job says)
        apply_precision(kwargs.pop("precision", None), job.training)
        if kwargs.get("strategy", "auto") == "auto":
            kwargs["strategy"] = TitanStrategy()  # degrees from job.parallelism
        L.seed_everything(job.training.seed, verbose=False)
    folder = run_dir(run, kwargs.get("default_root_dir"))
    kwargs["default_root_dir"] = str(folder)
    if kwargs.get("logger") in (None, True):
        kwargs["logger"] = [
            TensorBoardLogger(save_dir=folder, name="tensorboard", version=""),
            CSVLogger(save_dir=folder, name="csv", version=""),
        ]
    callbacks = list(kwargs.get("callbacks") or [])
    if job is not None and not any(isinstance(c, TrainingMetrics) for c in callbacks):
        callbacks.append(TrainingMetrics())
    if job is not None and job.data.sources and not any(isinstance(c, SourceTokens) for c in callbacks):
        callbacks.append(SourceTokens())
    if job is not None and not any(isinstance(c, PreemptionCheckpoint) for c in callbacks):
        callbacks.append(PreemptionCheckpoint())
    if job is not None and not any(isinstance(c, FinalValidation) for c in callbacks):
        callbacks.append(FinalValidation())
    if kwargs.get("enable_checkpointing", True) and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
        callbacks.append(checkpoint_callback(job, folder))
    if job is not None and job.checkpoint.initial_load_path is not None:
        callbacks.append(LoadWeights(job.checkpoint.initial_load_path, job.checkpoint.initial_load_format))
    if job is not None and (job.profiling.trace_steps or job.profiling.memory_snapshot_steps):
        callbacks.append(ProfileSteps(folder / "profile", job.profiling.trace_steps, job.profiling.memory_snapshot_steps))
    if job is not None and job.checkpoint.export_format is not None:
        where = folder / ("export_hf" if job.checkpoint.export_format == "hf" else "export")
        callbacks.append(ExportWeights(where, job.checkpoint.export_format, job.checkpoint.export_dtype))
    if run.config_text:  # (parse_run's: the command line's run)
        callbacks.append(RunConfig(folder, run.config_text))
    if kwargs.get("enable_progress_bar") is not False:
        callbacks = _progress_bar(callbacks)
    kwargs["callbacks"] = callbacks
    trainer = L.Trainer(**kwargs)
    if job is not None and run.device_choice is not None:  # (the device is known; the job not yet checked)
        device_defaults.apply(run, trainer)
        job = run.job
    if isinstance(trainer.strategy, TitanStrategy):  # (the job with the module, once)
        trainer.strategy.check_module(run.module, max_steps=trainer.max_steps)
    elif job is not None:
        validate_job(job, world_size=trainer.world_size, max_steps=trainer.max_steps,
                     device_type=trainer.strategy.root_device.type)
    if job is not None:
        _validate_vocab(run, job)
        trainer.accumulate_grad_batches = gradient_accumulation_steps(job, trainer.world_size)
    return trainer

