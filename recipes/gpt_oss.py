"""gpt-oss runs: the CPU debug model and the published sizes."""

from titan_lightning.models.gpt_oss import GptOssJob, GptOssModule, gpt_oss_args
from titan_lightning.recipe import Run, debug_run, family_run, on_layout, size_run


def gpt_oss(flavor: str, **job_sections) -> Run:
    """A gpt-oss run of one size on the shipped corpus; sections override the defaults."""
    return family_run(GptOssJob, GptOssModule, gpt_oss_args(flavor), **job_sections)


def debugmodel() -> Run:
    """The debug model: 4 layers (sliding and full), sinks, YaRN, 8 experts top-2 (9M parameters, 4M active)."""
    return debug_run(GptOssJob, GptOssModule, gpt_oss_args("debugmodel"))


def fsdp2_ep2() -> Run:
    """2 ranks: FSDP2, the experts over EP2 (4 each)."""
    return on_layout(debugmodel(), dp_shard=2, ep=2)


def _size(flavor: str) -> Run:
    return size_run(GptOssJob, GptOssModule, gpt_oss_args(flavor), seq_len=8192, lr=3e-4)


def gpt_oss_20b() -> Run:
    return _size("20B")


def gpt_oss_120b() -> Run:
    return _size("120B")
