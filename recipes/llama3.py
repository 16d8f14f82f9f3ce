"""Llama 3 runs: the CPU debug model and the published sizes."""

from titan_lightning.config import LRScheduleConfig, OptimizerConfig, TrainingConfig
from titan_lightning.data.datamodule import TextDataModule
from titan_lightning.models.llama3 import Llama3Job, Llama3Module, llama3_args
from titan_lightning.recipe import Run


def llama3(flavor: str, **job_sections) -> Run:
    """A Llama 3 run of one size on the shipped corpus; sections override the defaults."""
    job = Llama3Job(model=llama3_args(flavor), **job_sections)
    return Run(module=Llama3Module(job), datamodule=TextDataModule(job), trainer=dict(max_steps=1000))


def debugmodel() -> Run:
    """Trains on 2 CPU cores in about two minutes; the loss falls by more than 2 nats."""
    run = llama3(
        "debugmodel",
        training=TrainingConfig(seq_len=256, tokens_per_microbatch_per_dp_rank=2048, max_grad_norm=1.0),
        optimizer=OptimizerConfig(lr=2e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=10, decay_ratio=0.5),
    )
    run.trainer.update(max_steps=100, log_every_n_steps=1, val_check_interval=50, limit_val_batches=4)
    return run


def _size(flavor: str) -> Run:
    return llama3(
        flavor,
        training=TrainingConfig(
            seq_len=8192, tokens_per_microbatch_per_dp_rank=8192, dtype="float32", mixed_precision_param="bfloat16"
        ),
        optimizer=OptimizerConfig(lr=3e-4),
        lr_schedule=LRScheduleConfig(warmup_steps=200, decay_ratio=0.2),
    )


def llama3_1b() -> Run:
    return _size("1B")


def llama3_3b() -> Run:
    return _size("3B")


def llama3_8b() -> Run:
    return _size("8B")


def llama3_70b() -> Run:
    return _size("70B")


def llama3_405b() -> Run:
    return _size("405B")


def on_layout(run: Run, **degrees) -> Run:
    """``run`` on a parallel layout with the same global batch, so the same per-step losses.

    The data-parallel degree must be explicit (``dp_shard=-1`` would depend on the launch).
    """
    for name, value in degrees.items():
        setattr(run.job.parallelism, name, value)
    p = run.job.parallelism
    run.job.training.tokens_per_microbatch_per_dp_rank //= p.dp_replicate * max(p.dp_shard, 1)
    return run


def _debug_layout(**degrees) -> Run:
    return on_layout(debugmodel(), **degrees)


# The debug model on parallel layouts; launch with the matching world size, e.g.
#   titan-lightning fit --recipe recipes.llama3:fsdp2_tp2 --trainer.devices 4 --trainer.accelerator cpu
def fsdp2() -> Run:
    return _debug_layout(dp_shard=2)


def ddp2() -> Run:
    return _debug_layout(dp_replicate=2, dp_shard=1)


def hsdp2x2() -> Run:
    return _debug_layout(dp_replicate=2, dp_shard=2)


def tp2() -> Run:
    return _debug_layout(dp_shard=1, tp=2)


def fsdp2_tp2() -> Run:
    return _debug_layout(dp_shard=2, tp=2)
