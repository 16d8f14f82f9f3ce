"""Gemma 3 (text) runs: the CPU debug model and the published sizes."""

from titan_lightning.models.gemma3 import Gemma3Job, Gemma3Module, gemma3_args
from titan_lightning.recipe import Run, debug_run, family_run, on_layout, size_run


def gemma3(flavor: str, **job_sections) -> Run:
    """A Gemma 3 run of one size on the shipped corpus; sections override the defaults."""
    return family_run(Gemma3Job, Gemma3Module, gemma3_args(flavor), **job_sections)


def debugmodel() -> Run:
    """The debug model (6M parameters: two sliding layers to one global, window 64), trainable on 2 CPU cores."""
    return debug_run(Gemma3Job, Gemma3Module, gemma3_args("debugmodel"))


def fsdp2_tp2() -> Run:
    """4 ranks: FSDP2 x TP2, the four norms of each block on the sequence shard."""
    return on_layout(debugmodel(), dp_shard=2, tp=2)


def _size(flavor: str) -> Run:
    return size_run(Gemma3Job, Gemma3Module, gemma3_args(flavor), seq_len=8192, lr=3e-4)


def gemma3_270m() -> Run:
    return _size("270M")


def gemma3_1b() -> Run:
    return _size("1B")


def gemma3_4b() -> Run:
    return _size("4B")


def gemma3_12b() -> Run:
    return _size("12B")


def gemma3_27b() -> Run:
    return _size("27B")
