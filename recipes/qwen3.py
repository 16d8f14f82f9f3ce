"""Qwen 3 runs: the CPU debug models (dense and MoE) and the published sizes."""

from dataclasses import replace

from titan_lightning.models.qwen3 import Qwen3Job, Qwen3Module, qwen3_args
from titan_lightning.recipe import Run, debug_run, family_run, on_layout, size_run, with_cp


def qwen3(flavor: str, **job_sections) -> Run:
    """A Qwen 3 run of one size on the shipped corpus; sections override the defaults."""
    return family_run(Qwen3Job, Qwen3Module, qwen3_args(flavor), **job_sections)


def debugmodel() -> Run:
    """The dense debug model (12M parameters), trainable on 2 CPU cores."""
    return debug_run(Qwen3Job, Qwen3Module, qwen3_args("debugmodel"))


def debugmodel_moe() -> Run:
    """The MoE debug model: 64 experts, top-8 (33M parameters, 11M active), trainable on CPU."""
    return debug_run(Qwen3Job, Qwen3Module, qwen3_args("debugmodel_moe"))


def _size(flavor: str) -> Run:
    return size_run(Qwen3Job, Qwen3Module, qwen3_args(flavor), seq_len=4096, lr=3e-4)


def qwen3_0_6b() -> Run:
    return _size("0.6B")


def qwen3_1_7b() -> Run:
    return _size("1.7B")


def qwen3_4b() -> Run:
    return _size("4B")


def qwen3_8b() -> Run:
    return _size("8B")


def qwen3_14b() -> Run:
    return _size("14B")


def qwen3_32b() -> Run:
    return _size("32B")


def qwen3_30b_a3b() -> Run:
    return _size("30B-A3B")


def qwen3_235b_a22b() -> Run:
    return _size("235B-A22B")


# The debug MoE model on expert-parallel layouts, with the same global batch as one process
# (titan_lightning.recipe.on_layout, with_cp), e.g.
#   titan-lightning fit --recipe recipes.qwen3:fsdp2_tp2_cp2_ep8 --trainer.devices 8 --trainer.accelerator cpu
def moe_fsdp2_ep2() -> Run:
    return on_layout(debugmodel_moe(), dp_shard=2, ep=2)


def moe_fsdp4_ep4() -> Run:
    return on_layout(debugmodel_moe(), dp_shard=4, ep=4)


def fsdp2_tp2_cp2_ep8() -> Run:
    """8 ranks: the dense region FSDP2 x TP2 (sequence parallel) x CP2 (all-gather K/V), the
    routed experts over all 8 ranks (EP8, efsdp 1: 8 of the 64 experts per rank)."""
    return with_cp(debugmodel_moe(), "allgather", cp=2, dp_shard=2, tp=2, ep=8)


def moe_235b_a22b_layout() -> Run:
    """A 235B-A22B-scale layout on the debug-sized MoE, for a FakePG dry run at world size 256:
    FSDP64 x TP4 in the dense region, one of the 64 experts per rank over EP64 (efsdp 4)."""
    run = debugmodel_moe()
    job = run.job
    run.set_job(replace(job, parallelism=replace(job.parallelism, dp_shard=64, tp=4, ep=64),
                        training=replace(job.training, tokens_per_microbatch_per_dp_rank=job.training.seq_len)))
    return run
