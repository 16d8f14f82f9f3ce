"""Llama 3 runs: the CPU debug model and the published sizes."""

from titan_lightning.config import LRScheduleConfig, OptimizerConfig, TrainingConfig
from titan_lightning.data.datamodule import TextDataModule
from titan_lightning.models.llama3 import Llama3Job, Llama3Module, llama3_args
from titan_lightning.recipe import Run
from titan_lightning.transforms import ContextParallelTransform, apply_transforms


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


def with_cp(run: Run, attention: str = "allgather", *, cp: int, **degrees) -> Run:
    """``run`` with a context-parallel attention over ``cp`` ranks, then ``on_layout(**degrees)``."""
    return on_layout(apply_transforms(run, [ContextParallelTransform(attention=attention, cp=cp)]), **degrees)


# Context parallel: the debug model with a CP attention (allgather unless named).
def _debug_cp(attention: str = "allgather", **degrees) -> Run:
    return with_cp(debugmodel(), attention, **degrees)


def cp2() -> Run:
    return _debug_cp(cp=2, dp_shard=1)


def cp4() -> Run:
    return _debug_cp(cp=4, dp_shard=1)


def cp2_ring() -> Run:
    return _debug_cp("ring", cp=2, dp_shard=1)


def cp2_ulysses() -> Run:
    return _debug_cp("ulysses", cp=2, dp_shard=1)


def fsdp2_cp2() -> Run:
    return _debug_cp(cp=2, dp_shard=2)


def hsdp2_cp2() -> Run:
    return _debug_cp(cp=2, dp_replicate=2, dp_shard=1)


def fsdp2_tp2_cp2() -> Run:
    return _debug_cp(cp=2, dp_shard=2, tp=2)


# Pipeline parallel: the debug model's 6 layers in stages; the local batch splits into microbatches.
#   titan-lightning fit --recipe recipes.llama3:pp2_fsdp2_tp2 --trainer.devices 8 --trainer.accelerator cpu
def _debug_pp(schedule: str = "1F1B", microbatches: int = 4, **degrees) -> Run:
    return _debug_layout(pp_schedule=schedule, pp_microbatches=microbatches, **degrees)


def pp2() -> Run:
    """2 stages, 1F1B over 4 microbatches of 2 sequences."""
    return _debug_pp(pp=2, dp_shard=1)


def pp2_fsdp2() -> Run:
    return _debug_pp(pp=2, dp_shard=2)


def pp2_tp2() -> Run:
    return _debug_pp("GPipe", pp=2, dp_shard=1, tp=2)


def pp2_fsdp2_tp2() -> Run:
    """8 ranks: 2 stages, each FSDP2 x TP2; 1F1B over 4 microbatches of 1 sequence."""
    return _debug_pp(pp=2, dp_shard=2, tp=2)


def pp2_interleaved() -> Run:
    """Interleaved 1F1B: 4 stages, 2 per rank (loop placement)."""
    return _debug_pp("Interleaved1F1B", pp=2, dp_shard=1)


def llama3_8b_fsdp8_cp8() -> Run:
    """Llama 3 8B at 131,072-token sequences on 64 GPUs: FSDP8 x CP8, one sequence per FSDP rank.

    Each CP rank holds 16,384 tokens of every sequence (headtail), all-gather K/V attention.
    Dry run in one process: ``--trainer.strategy FakePGStrategy --trainer.strategy.world_size 64``.
    """
    run = llama3_8b()
    run.job.training.seq_len = run.job.training.tokens_per_microbatch_per_dp_rank = 131072
    run = apply_transforms(run, [ContextParallelTransform(attention="allgather", cp=8)], world_size=64)
    run.job.parallelism.dp_shard = 8
    # 16,384 tokens x 32 blocks of activations do not fit one GPU without recomputation.
    run.job.activation_checkpoint.mode = "full"
    # The shipped corpus (128k tokens) is shorter than one sequence: repeat it; no val split.
    run.job.data.repeat_to_fit = True
    run.trainer.update(limit_val_batches=0, num_sanity_val_steps=0)
    return run
