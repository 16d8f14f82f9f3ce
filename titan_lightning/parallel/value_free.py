"""What the code assumes where it reads a tensor's values on the host, while tensors hold none.

The memory estimator (estimate.py) runs a step on fake tensors: shapes, dtypes and storages, no
data. A few places of a step decide something from values, and ask ``assumed()`` first: None in a
run (they compute as always); inside ``assuming(...)``, the ``Assumptions`` to use instead:

    models/common/moe.py   the tokens each expert gets (``count_tokens``, from the router's choice),
                           and whether tokens take the grouped GEMM (``grouped_mm_available``)
    parallel/expert.py     expert parallelism's split sizes (``ExpertParallel.splits``: exchanged,
                           then read on the host)
    parallel/context_attention.py   all-gather CP's ``causal_lower_right`` mask (a tensor subclass
                           that fake tensors refuse)
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    """``count_tokens(experts, num_experts)``: tokens per expert [num_experts] int64 from the router's
    expert ids; ``grouped_mm(x)``: whether tokens like ``x`` take ``torch._grouped_mm`` when the
    model leaves it to the device; ``ep_splits(ep, counts)``: ``ExpertParallel.splits``' result
    for the ``ExpertParallel`` ``ep``; ``lower_right_mask``: False attends all-gather CP's runs of
    queries unmasked (the same shapes and saved tensors as the masked kernel)."""

    count_tokens: Callable[[torch.Tensor, int], torch.Tensor]
    grouped_mm: Callable[[torch.Tensor], bool]
    ep_splits: Callable[[Any, torch.Tensor], tuple[list[int], list[list[int]], torch.Tensor]]
    lower_right_mask: bool = True


_ASSUMED: Optional[Assumptions] = None


def assumed() -> Optional[Assumptions]:
    """The assumptions in force, or None (a run: compute from the values)."""
    return _ASSUMED


@contextmanager
def assuming(assumptions: Assumptions) -> Iterator[None]:
    """``assumptions`` are in force inside the block."""
    global _ASSUMED
    previous, _ASSUMED = _ASSUMED, assumptions
    try:
        yield
    finally:
        _ASSUMED = previous
