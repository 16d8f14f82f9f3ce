"""Phi-3 and Phi-4 runs: the CPU debug model and the published sizes."""

from titan_lightning.models.phi3 import Phi3Job, Phi3Module, phi3_args
from titan_lightning.recipe import Run, debug_run, family_run, size_run


def phi3(flavor: str, **job_sections) -> Run:
    """A Phi-3 / Phi-4 run of one size on the shipped corpus; sections override the defaults."""
    return family_run(Phi3Job, Phi3Module, phi3_args(flavor), **job_sections)


def debugmodel() -> Run:
    """The debug model (6M parameters, RoPE on 12 of each head's 16 features), trainable on 2 CPU cores."""
    return debug_run(Phi3Job, Phi3Module, phi3_args("debugmodel"))


def _size(flavor: str, seq_len: int) -> Run:
    return size_run(Phi3Job, Phi3Module, phi3_args(flavor), seq_len=seq_len, lr=3e-4)


def phi3_mini_4k() -> Run:
    return _size("mini-4k", 4096)


def phi3_medium_4k() -> Run:
    return _size("medium-4k", 4096)


def phi4() -> Run:
    return _size("phi-4", 16384)


def phi4_mini() -> Run:
    return _size("phi-4-mini", 4096)
