"""Collectives shared by context and expert parallelism (and OLMo 2's QK-norm under TP); the ``*_autograd`` ones carry
gradients (an all-gather's is reduce-scattered back, and so on).

Functional collectives, looked up at call time: under the fake process group its
deterministic versions (parallel/fake.py) take their place.
"""

import torch

from titan_lightning._compat import funcol


def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order."""
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return funcol.wait_tensor(gather(x.movedim(dim, 0).contiguous(), 0, group)).movedim(0, dim)


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """``x`` summed over the group; this rank's chunk of ``dim``."""
    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return funcol.wait_tensor(scatter(x.movedim(dim, 0).contiguous(), "sum", 0, group)).movedim(0, dim)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over the group."""
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


def all_to_all(x: torch.Tensor, group, output_splits=None, input_splits=None) -> torch.Tensor:
    """Rows of ``x`` sent to each rank (``input_splits`` each), rows received from each
    (``output_splits``); equal splits when None."""
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), output_splits, input_splits, group))


class _GatherScatter(torch.autograd.Function):
    """``all_gather`` (``gather``) or ``reduce_scatter`` along ``dim``; the gradient takes the other."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, gather: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.gather = dim, group, gather
        return (all_gather if gather else reduce_scatter)(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (reduce_scatter if ctx.gather else all_gather)(grad, ctx.dim, ctx.group), None, None, None


def all_gather_autograd(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _GatherScatter.apply(x, dim, group, True)


def reduce_scatter_autograd(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _GatherScatter.apply(x, dim, group, False)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad, ctx.group), None


def all_reduce_autograd(x: torch.Tensor, group) -> torch.Tensor:
    """``all_reduce``; every rank used the sum, so each one's gradient is the sum of all of theirs."""
    return _AllReduce.apply(x, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, output_splits, input_splits) -> torch.Tensor:
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return all_to_all(grad, ctx.group, input_splits, output_splits), None, None, None


def all_to_all_autograd(x: torch.Tensor, group, output_splits=None, input_splits=None) -> torch.Tensor:
    """``all_to_all``; the gradient takes the reverse exchange."""
    return _AllToAll.apply(x, group, output_splits, input_splits)
