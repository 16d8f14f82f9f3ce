"""Tensor parallelism (TP, with optional sequence parallelism and loss parallelism).

A model declares *what* is sharded with a plan: module-name patterns mapped to style
names, e.g. ``{"layers.*.attention.wq": "colwise"}`` (``*`` matches one name part, so it
stands for a layer index). This file knows *how* each style is sharded:

    embedding            rows of the table (vocab); the output is replicated, or sharded
                         on the sequence with sequence parallelism
    colwise              output features; the input is replicated, the output stays local
    rowwise              input features; the output is all-reduced (replicated), or
                         reduce-scattered on the sequence with sequence parallelism
    norm                 replicated weights; with sequence parallelism it runs on the local
                         sequence shard, without it on the whole (replicated) sequence
    prepare_block_input  with sequence parallelism: all-gathers the first input (the hidden
                         states) of an attention or feed-forward module before its colwise
                         projections; the other inputs (RoPE tables, masks) pass through
    output               the LM head, colwise over the vocab; the logits come back whole,
                         or stay a vocab-sharded DTensor for loss parallelism
    replicate            replicated weights on the replicated (whole-sequence) input, with or
                         without sequence parallelism (e.g. MLA's low-rank projections and
                         their norms, inside the attention after the sequence all-gather)
    head_norm            a norm over each head's features (QK-norm) on [B, S, H_local, D]:
                         weights replicated, the input taken as sharded on the heads (dim
                         2), so the weight gradient sums the TP ranks' heads
    head_shared          an identity marking a replicated tensor that head-local (TP-sharded)
                         work consumes directly, not through a colwise projection: its
                         gradient is summed over the TP ranks (e.g. MLA's rotary key)
    moe                  a mixture-of-experts layer under sequence parallelism: it takes the
                         local sequence shard as a plain tensor and returns one (its tokens
                         are this rank's own; the routed experts are expert-parallel)
    moe_replicated       a per-token module inside an MoE layer (router gate, shared
                         experts): weights replicated on the TP mesh, run on the rank's own
                         tokens (dim 0), gradients summed over the TP ranks

Every parameter of a sharded module becomes a DTensor on the TP mesh, norms included, so
one grad-norm and one optimizer path serve the whole model.

Weights are not broadcast (``src_data_rank=None``): build the model on the meta device,
apply TP, then materialize it; the layout-independent init gives every rank its own shard.
"""

import inspect
from fnmatch import fnmatchcase
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

# (module, sequence_parallel, loss_parallel) -> the style to apply, or None for nothing.
StyleFactory = Callable[[nn.Module, bool, bool], Optional[ParallelStyle]]


def _activation(sequence_parallel: bool) -> Placement:
    """Layout of the residual stream between blocks."""
    return Shard(1) if sequence_parallel else Replicate()


def _embedding(module: nn.Module, sp: bool, loss_parallel: bool) -> ParallelStyle:
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=_activation(sp))


def _colwise(module: nn.Module, sp: bool, loss_parallel: bool) -> ParallelStyle:
    return ColwiseParallel()


def _rowwise(module: nn.Module, sp: bool, loss_parallel: bool) -> ParallelStyle:
    return RowwiseParallel(output_layouts=_activation(sp))


def _norm(module: nn.Module, sp: bool, loss_parallel: bool) -> ParallelStyle:
    return SequenceParallel() if sp else ReplicateParallel()


def _prepare_block_input(module: nn.Module, sp: bool, loss_parallel: bool) -> Optional[ParallelStyle]:
    if not sp:
        return None  # the input is already a replicated local tensor, which colwise expects
    rest = (None,) * (_positional_arity(module) - 1)
    return PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))


def _moe(module: nn.Module, sp: bool, loss_parallel: bool) -> ParallelStyle:
    if not sp:
        # Every TP rank would route the same tokens to the experts: their gradients would count
        # each token tp times. Checked before launch (config.validation); this is the backstop.
        raise ValueError("an MoE layer under tensor parallelism needs parallelism.sequence_parallel=True")
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)


def _moe_replicated(module: nn.Module, sp: bool, loss_parallel: bool) -> ParallelStyle:
    return SequenceParallel(sequence_dim=0, use_local_output=True)


def _output(module: nn.Module, sp: bool, loss_parallel: bool) -> ParallelStyle:
    return ColwiseParallel(
        input_layouts=_activation(sp),
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )


class HeadShared(ParallelStyle):
    """Identity forward; in the backward, the gradient is summed over the TP ranks.

    Each rank's heads contribute part of the gradient of a tensor they all read; read as a
    Partial DTensor and redistributed to Replicate, the parts add up.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, _replicate_inputs, _partial_grad_output)


def _partial_grad_output(module: nn.Module, output, mesh: DeviceMesh):
    return output.to_local(grad_placements=[Partial()]) if isinstance(output, DTensor) else output


class ReplicateParallel(ParallelStyle):
    """Weights replicated on the TP mesh; inputs and outputs are replicated local tensors.

    Every TP rank computes the same thing (a norm without sequence parallelism), but the
    weights are DTensors like the rest of the model's.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _replicate_params, _replicate_inputs, _local_output)


def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        # Every rank holds the same values (layout-independent init): no broadcast.
        replicated = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
        module.register_parameter(param_name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _replicate_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _local_output(module: nn.Module, output, mesh: DeviceMesh):
    return output.to_local() if isinstance(output, DTensor) else output


STYLES: dict[str, StyleFactory] = {
    "embedding": _embedding,
    "colwise": _colwise,
    "rowwise": _rowwise,
    "norm": _norm,
    "prepare_block_input": _prepare_block_input,
    "output": _output,
    "replicate": lambda module, sp, loss_parallel: ReplicateParallel(),
    "head_shared": lambda module, sp, loss_parallel: HeadShared(),
    "head_norm": lambda module, sp, loss_parallel: SequenceParallel(sequence_dim=2, use_local_output=True),
    "moe": _moe,
    "moe_replicated": _moe_replicated,
}

# The weight dimension each style splits across the TP ranks (nn.Linear weights are [out, in]).
_SHARDED_WEIGHT_DIM = {"embedding": 0, "colwise": 0, "output": 0, "rowwise": 1}


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: dict[str, str],
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
) -> nn.Module:
    """Shard ``model`` over the 1-D ``tp_mesh`` as ``plan`` says; the model is changed in place.

    The whole plan is checked (style names, patterns, divisible sizes) before anything is
    sharded. With ``loss_parallel`` the model returns vocab-sharded DTensor logits: compute
    the loss and run backward inside ``torch.distributed.tensor.parallel.loss_parallel()``.
    """
    resolved = [
        (fqn, module, style) for pattern, style in plan.items() for fqn, module in _resolve(model, pattern, style)
    ]
    for fqn, module, style in resolved:
        _check_divisible(fqn, module, style, tp_mesh.size())
    for fqn, module, style in resolved:
        parallel_style = STYLES[style](module, sequence_parallel, loss_parallel)
        if parallel_style is not None:
            parallelize_module(module, tp_mesh, parallel_style, src_data_rank=None)
    return model


def _resolve(model: nn.Module, pattern: str, style: str) -> list[tuple[str, nn.Module]]:
    if style not in STYLES:
        raise ValueError(f"TP plan entry {pattern!r}: unknown style {style!r}; valid styles are {', '.join(STYLES)}")
    matches, removed = _match(model, pattern)
    if not matches and not removed:
        raise ValueError(
            f"TP plan pattern {pattern!r} (style {style!r}) matches no module of {type(model).__name__}; "
            f"patterns are module names with '*' for one name part, e.g. 'layers.*.attention.wq'"
        )
    return matches


def _match(model: nn.Module, pattern: str) -> tuple[list[tuple[str, nn.Module]], int]:
    """Modules whose name matches ``pattern`` part by part, and how many matched slots are None.

    A None slot is a submodule a pipeline stage removed (``model.output = None``): it is
    skipped, not an error.
    """
    frontier: list[tuple[str, nn.Module]] = [("", model)]
    removed = 0
    for part in pattern.split("."):
        found = []
        for fqn, module in frontier:
            for name, child in module._modules.items():  # named_children() would hide the None slots
                if not fnmatchcase(name, part):
                    continue
                if child is None:
                    removed += 1
                else:
                    found.append((f"{fqn}.{name}" if fqn else name, child))
        frontier = found
    return frontier, removed


def _check_divisible(fqn: str, module: nn.Module, style: str, tp: int) -> None:
    dim = _SHARDED_WEIGHT_DIM.get(style)
    weight = getattr(module, "weight", None)
    if dim is None or weight is None:
        return
    if weight.shape[dim] % tp:
        raise ValueError(
            f"TP style {style!r} splits dim {dim} of {fqn}.weight {tuple(weight.shape)}, "
            f"which is not divisible by parallelism.tp={tp}; choose a tp degree that divides {weight.shape[dim]}"
        )


def _positional_arity(module: nn.Module) -> int:
    """How many positional inputs ``module.forward`` takes (PrepareModuleInput needs one layout each)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in inspect.signature(module.forward).parameters.values())
