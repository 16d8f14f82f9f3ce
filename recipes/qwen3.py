"""Qwen 3 runs: the CPU debug models (dense and MoE) and the published sizes."""

from titan_lightning.config import LRScheduleConfig, OptimizerConfig, TrainingConfig
from titan_lightning.data.datamodule import TextDataModule
from titan_lightning.models.qwen3 import Qwen3Job, Qwen3Module, qwen3_args
from titan_lightning.recipe import Run
from recipes.llama3 import on_layout, with_cp


def qwen3(flavor: str, **job_sections) -> Run:
    """A Qwen 3 run of one size on the shipped corpus; sections override the defaults."""
    job = Qwen3Job(model=qwen3_args(flavor), **job_sections)
    return Run(module=Qwen3Module(job), datamodule=TextDataModule(job), trainer=dict(max_steps=1000))


def _debug(flavor: str) -> Run:
    run = qwen3(
        flavor,
        training=TrainingConfig(seq_len=256, tokens_per_microbatch_per_dp_rank=2048, max_grad_norm=1.0),
        optimizer=OptimizerConfig(lr=2e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=10, decay_ratio=0.5),
    )
    run.trainer.update(max_steps=100, log_every_n_steps=1, val_check_interval=50, limit_val_batches=4)
    return run


def debugmodel() -> Run:
    """The dense debug model (12M parameters), trainable on 2 CPU cores."""
    return _debug("debugmodel")


def debugmodel_moe() -> Run:
    """The MoE debug model: 64 experts, top-8 (33M parameters, 11M active), trainable on CPU."""
    return _debug("debugmodel_moe")


def _size(flavor: str) -> Run:
    return qwen3(
        flavor,
        training=TrainingConfig(
            seq_len=4096, tokens_per_microbatch_per_dp_rank=4096, dtype="float32", mixed_precision_param="bfloat16"
        ),
        optimizer=OptimizerConfig(lr=3e-4),
        lr_schedule=LRScheduleConfig(warmup_steps=200, decay_ratio=0.2),
    )


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
# (recipes.llama3.on_layout / with_cp), e.g.
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
    run = on_layout(debugmodel_moe(), dp_shard=64, tp=4, ep=64)
    run.job.training.tokens_per_microbatch_per_dp_rank = run.job.training.seq_len
    return run
