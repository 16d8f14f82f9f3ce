"""DeepSeek V3 runs: the CPU debug model and the published sizes."""

from titan_lightning.config import LRScheduleConfig, OptimizerConfig, TrainingConfig
from titan_lightning.data.datamodule import TextDataModule
from titan_lightning.models.deepseek_v3 import DeepSeekV3Job, DeepSeekV3Module, deepseek_v3_args
from titan_lightning.recipe import Run
from recipes.llama3 import on_layout


def deepseek_v3(flavor: str, **job_sections) -> Run:
    """A DeepSeek V3 run of one size on the shipped corpus; sections override the defaults."""
    job = DeepSeekV3Job(model=deepseek_v3_args(flavor), **job_sections)
    return Run(module=DeepSeekV3Module(job), datamodule=TextDataModule(job), trainer=dict(max_steps=1000))


def debugmodel() -> Run:
    """The 14M-parameter debug model (8 routed + 2 shared experts), sized for CPU; seq_len 256 like llama3's."""
    run = deepseek_v3(
        "debugmodel",
        training=TrainingConfig(seq_len=256, tokens_per_microbatch_per_dp_rank=2048, max_grad_norm=1.0),
        optimizer=OptimizerConfig(lr=2e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=10, decay_ratio=0.5),
    )
    run.trainer.update(max_steps=100, log_every_n_steps=1, val_check_interval=50, limit_val_batches=4)
    return run


def _size(flavor: str) -> Run:
    return deepseek_v3(
        flavor,
        training=TrainingConfig(
            seq_len=4096, tokens_per_microbatch_per_dp_rank=4096, dtype="float32", mixed_precision_param="bfloat16"
        ),
        optimizer=OptimizerConfig(lr=2.2e-4),
        lr_schedule=LRScheduleConfig(warmup_steps=200, decay_ratio=0.2),
    )


def deepseek_v3_16b() -> Run:
    return _size("16B")


def deepseek_v3_671b() -> Run:
    return _size("671B")


# The debug model on expert-parallel layouts (the same global batch as one process), e.g.
#   titan-lightning fit --recipe recipes.deepseek_v3:fsdp2_ep2 --trainer.devices 2 --trainer.accelerator cpu
def fsdp2_ep2() -> Run:
    """FSDP over 2 ranks; each holds 4 of the 8 routed experts."""
    return on_layout(debugmodel(), dp_shard=2, ep=2)


def fsdp4_ep4() -> Run:
    return on_layout(debugmodel(), dp_shard=4, ep=4)


def fsdp4_ep2() -> Run:
    """Experts over 2 ranks and FSDP-sharded over the other 2 (efsdp=2)."""
    return on_layout(debugmodel(), dp_shard=4, ep=2)


def hsdp2_fsdp2_ep2() -> Run:
    """Two replicas of fsdp2_ep2: experts replicated across dp_replicate (4 ranks)."""
    return on_layout(debugmodel(), dp_replicate=2, dp_shard=2, ep=2)


def tp2_ep2() -> Run:
    """TP2 with sequence parallelism; the two TP ranks route their own sequence halves to 4 experts each."""
    return on_layout(debugmodel(), dp_shard=1, tp=2, ep=2)
