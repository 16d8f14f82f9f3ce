"""Qwen 2.5 runs: the CPU debug model and the published sizes."""

from titan_lightning.models.qwen2 import Qwen2Job, Qwen2Module, qwen2_args
from titan_lightning.recipe import Run, debug_run, family_run, on_layout, size_run


def qwen2(flavor: str, **job_sections) -> Run:
    """A Qwen 2.5 run of one size on the shipped corpus; sections override the defaults."""
    return family_run(Qwen2Job, Qwen2Module, qwen2_args(flavor), **job_sections)


def debugmodel() -> Run:
    """The debug model (6M parameters, q/k/v biases), trainable on 2 CPU cores."""
    return debug_run(Qwen2Job, Qwen2Module, qwen2_args("debugmodel"))


def fsdp2_tp2() -> Run:
    """4 ranks: FSDP2 x TP2, each q/k/v bias split with its heads."""
    return on_layout(debugmodel(), dp_shard=2, tp=2)


def _size(flavor: str) -> Run:
    return size_run(Qwen2Job, Qwen2Module, qwen2_args(flavor), seq_len=4096, lr=3e-4)


def qwen2_5_0_5b() -> Run:
    return _size("0.5B")


def qwen2_5_1_5b() -> Run:
    return _size("1.5B")


def qwen2_5_3b() -> Run:
    return _size("3B")


def qwen2_5_7b() -> Run:
    return _size("7B")


def qwen2_5_14b() -> Run:
    return _size("14B")


def qwen2_5_32b() -> Run:
    return _size("32B")


def qwen2_5_72b() -> Run:
    return _size("72B")
