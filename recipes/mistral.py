"""Mistral and Mixtral runs: the CPU debug models (dense and MoE) and the published sizes."""

from titan_lightning.models.mistral import MistralJob, MistralModule, mistral_args
from titan_lightning.recipe import Run, debug_run, family_run, on_layout, size_run


def mistral(flavor: str, **job_sections) -> Run:
    """A Mistral / Mixtral run of one size on the shipped corpus; sections override the defaults."""
    return family_run(MistralJob, MistralModule, mistral_args(flavor), **job_sections)


def debugmodel() -> Run:
    """The dense debug model (6M parameters), trainable on 2 CPU cores."""
    return debug_run(MistralJob, MistralModule, mistral_args("debugmodel"))


def debugmodel_moe() -> Run:
    """The Mixtral-shaped debug model: 8 experts, top-2, 4 layers (8M parameters, 3M active)."""
    return debug_run(MistralJob, MistralModule, mistral_args("debugmodel_moe"))


def moe_fsdp2_ep2() -> Run:
    """2 ranks: FSDP2, the experts over EP2 (4 each)."""
    return on_layout(debugmodel_moe(), dp_shard=2, ep=2)


def _size(flavor: str) -> Run:
    return size_run(MistralJob, MistralModule, mistral_args(flavor), seq_len=8192, lr=3e-4)


def mistral_7b() -> Run:
    return _size("7B")


def mistral_nemo_12b() -> Run:
    return _size("Nemo-12B")


def mixtral_8x7b() -> Run:
    return _size("8x7B")


def mixtral_8x22b() -> Run:
    return _size("8x22B")
