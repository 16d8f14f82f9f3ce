"""DeepSeek V3 runs: the CPU debug model and the published sizes."""

from titan_lightning.models.deepseek_v3 import DeepSeekV3Job, DeepSeekV3Module, deepseek_v3_args
from titan_lightning.recipe import Run, debug_run, family_run, on_layout, size_run


def deepseek_v3(flavor: str, **job_sections) -> Run:
    """A DeepSeek V3 run of one size on the shipped corpus; sections override the defaults."""
    return family_run(DeepSeekV3Job, DeepSeekV3Module, deepseek_v3_args(flavor), **job_sections)


def debugmodel() -> Run:
    """The 14M-parameter debug model (8 routed + 2 shared experts), sized for CPU; seq_len 256 like llama3's."""
    return debug_run(DeepSeekV3Job, DeepSeekV3Module, deepseek_v3_args("debugmodel"))


def _size(flavor: str) -> Run:
    return size_run(DeepSeekV3Job, DeepSeekV3Module, deepseek_v3_args(flavor), seq_len=4096, lr=2.2e-4)


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
