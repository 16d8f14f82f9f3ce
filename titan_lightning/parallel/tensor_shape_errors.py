"""A module's forward that fails on the per-rank sizes tensor parallelism gave it, explained.

After ``apply_tp``, every module that owns sharded children (an attention, an MLP) re-raises a
shape error of its forward (a reshape, a split, a matmul) as one ``TensorParallelShapeError``
line: the module, its per-rank head counts, and what to declare in the plan (see the head counts
in parallel/tensor_plan_check.py).
"""

import re
from typing import Callable

import torch
from torch import nn

from titan_lightning.parallel.tensor_plan_check import HEAD_COUNT_NAMES, Entry, HeadCount, owners_of_sharded
from titan_lightning.parallel.tensor_styles import FUSED


class TensorParallelShapeError(RuntimeError):
    """A module's forward failed on the per-rank sizes that tensor parallelism gave it."""


# What a shape error of a reshape, a split or a matmul says (torch's and Python's unpacking).
_SHAPE_ERROR = re.compile(r"shape|size|unpack|dimension|mat1 and mat2", re.IGNORECASE)


class _ExplainShapeErrors:
    """A module's forward that re-raises its shape errors as one TensorParallelShapeError saying
    what to declare. Set as the module's ``forward`` (hooks run in ``__call__``, around it)."""

    def __init__(self, forward: Callable, explain: Callable[[str], str]) -> None:
        self.forward = forward
        self.explain = explain
        self.__wrapped__ = forward  # inspect.signature sees the module's own arguments

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.forward(*args, **kwargs)
        try:
            return self.forward(*args, **kwargs)
        except TensorParallelShapeError:
            raise
        except (RuntimeError, ValueError) as error:
            text = str(error).strip().splitlines()[0] if str(error).strip() else ""
            if not _SHAPE_ERROR.search(text):
                raise
            raise TensorParallelShapeError(self.explain(text)) from error


def explain_shape_errors(model: nn.Module, resolved: list[Entry], heads: list[HeadCount], tp: int) -> None:
    """Make every module that owns sharded children re-raise a shape error of its forward as a
    ``TensorParallelShapeError`` naming it, its per-rank head counts and what to declare."""
    sharded: dict[str, list[str]] = {}
    for entry in resolved:
        if entry.record.splitting:
            parent, _, name = entry.fqn.rpartition(".")
            sharded.setdefault(parent, []).append(f"{name}: {entry.style}")
    for fqn, owner in owners_of_sharded(model, resolved, lambda record: record.splitting).items():
        mine = (owner, getattr(owner, "config", None))
        local = [f"{c.label} {c.value} -> {c.value // tp}" for c in heads if any(c.owner is o for o in mine)]
        owner.forward = _ExplainShapeErrors(owner.forward, _explanation(fqn, owner, sharded[fqn], local, tp))


def _explanation(fqn: str, owner: nn.Module, children: list[str], local: list[str], tp: int) -> Callable[[str], str]:
    where = f"{fqn}." if fqn else ""
    done = f"made per-rank: {', '.join(local)}" if local else f"none found by name ({', '.join(HEAD_COUNT_NAMES)})"
    return lambda error: (
        f"{fqn or 'the model'} ({type(owner).__name__}): its forward failed under parallelism.tp={tp} ({error}). "
        f"Its sharded projections ({', '.join(children)}) give each rank 1/{tp} of their output features, so the "
        f"head counts it reads must be per-rank ({done}): declare them in tp_plan as '{where}<attr>': 'heads' (or "
        f"'{where}config.<attr>': 'heads'). Sizes read from a hidden size or the input's width (split(n_embd), "
        f"x.size(-1) // n_head) stay global: use a head size, and -1 for a merged width (y.reshape(B, T, -1)). "
        f"A fused projection whose rows are [all q; all k; all v] (nanoGPT's c_attn) needs the style '{FUSED}:3', "
        f"its output split with .chunk(3, dim=-1) (see titan_lightning/parallel/tensor.py)"
    )
