"""OLMo 2 runs: the CPU debug model and the published sizes."""

from titan_lightning.models.olmo2 import Olmo2Job, Olmo2Module, olmo2_args
from titan_lightning.recipe import Run, debug_run, family_run, size_run


def olmo2(flavor: str, **job_sections) -> Run:
    """An OLMo 2 run of one size on the shipped corpus; sections override the defaults."""
    return family_run(Olmo2Job, Olmo2Module, olmo2_args(flavor), **job_sections)


def debugmodel() -> Run:
    """The debug model (6M parameters, post-norm blocks), trainable on 2 CPU cores."""
    return debug_run(Olmo2Job, Olmo2Module, olmo2_args("debugmodel"))


def _size(flavor: str) -> Run:
    return size_run(Olmo2Job, Olmo2Module, olmo2_args(flavor), seq_len=4096, lr=3e-4)


def olmo2_1b() -> Run:
    return _size("1B")


def olmo2_7b() -> Run:
    return _size("7B")


def olmo2_13b() -> Run:
    return _size("13B")


def olmo2_32b() -> Run:
    return _size("32B")
