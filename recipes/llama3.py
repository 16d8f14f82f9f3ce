"""Llama 3 runs: the CPU debug model and the published sizes."""

from dataclasses import replace

from titan_lightning.models.llama3 import Llama3Job, Llama3Module, llama3_args
from titan_lightning.recipe import (
    ContextParallelTransform, Run, debug_run, family_run, on_layout, size_run, transformed, with_cp,
)


def llama3(flavor: str, **job_sections) -> Run:
    """A Llama 3 run of one size on the shipped corpus; sections override the defaults."""
    return family_run(Llama3Job, Llama3Module, llama3_args(flavor), **job_sections)


def debugmodel() -> Run:
    """Trains on 2 CPU cores in about two minutes; the loss falls by more than 2 nats."""
    return debug_run(Llama3Job, Llama3Module, llama3_args("debugmodel"))


def _size(flavor: str) -> Run:
    return size_run(Llama3Job, Llama3Module, llama3_args(flavor), seq_len=8192, lr=3e-4)


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
    run = transformed(llama3_8b(), [ContextParallelTransform(attention="allgather", cp=8)])
    job = run.job
    run.set_job(replace(
        job,
        training=replace(job.training, seq_len=131072, tokens_per_microbatch_per_dp_rank=131072),
        parallelism=replace(job.parallelism, dp_shard=8),
        # 16,384 tokens x 32 blocks of activations do not fit one GPU without recomputation.
        activation_checkpoint=replace(job.activation_checkpoint, mode="full"),
        # The shipped corpus (128k tokens) is shorter than one sequence: repeat it; no val split.
        data=replace(job.data, repeat_to_fit=True),
    ))
    run.trainer.update(limit_val_batches=0, num_sanity_val_steps=0)
    return run
