"""Tensor parallelism (TP, with optional sequence parallelism and loss parallelism).

A model declares *what* is sharded with a plan: module-name patterns mapped to style
names, e.g. ``{"layers.*.attention.wq": "colwise"}`` (``*`` matches one name part, so it
stands for a layer index). This file knows *how* each style is sharded:

    embedding            rows of the table (vocab); the output is replicated, or sharded
                         on the sequence with sequence parallelism
    colwise              output features; the input is replicated, the output stays local
    colwise_grouped      colwise, for a fused projection whose rows are grouped per head or
                         per query group ([q; k; v] of group 0, then of group 1, ...: GPT-NeoX,
                         Falcon): each rank gets whole groups. Plain 'colwise' on a fused qkv
                         is refused (below): the name says the rows are grouped
    rowwise              input features; the output is all-reduced (replicated), or
                         reduce-scattered on the sequence with sequence parallelism
    norm                 replicated weights; with sequence parallelism it runs on the local
                         sequence shard, without it on the whole (replicated) sequence
    post_norm            a norm on a sublayer's output before the residual add (Gemma's norms after
                         attention and the feed-forward, OLMo 2's post-norms): as norm, its output a
                         local tensor like the residual stream's
    prepare_block_input  with sequence parallelism: all-gathers the first input (the hidden
                         states) of an attention or feed-forward module before its colwise
                         projections; the other inputs (RoPE tables, masks) pass through
    output               the LM head, colwise over the vocab; the logits come back whole,
                         or stay a vocab-sharded DTensor for loss parallelism; a head that
                         computes the loss itself (chunked) returns it as a plain tensor
    replicate            replicated weights on the replicated (whole-sequence) input, with or
                         without sequence parallelism (e.g. MLA's low-rank projections and
                         their norms, inside the attention after the sequence all-gather)
    head_norm            a norm over each head's features (QK-norm) on [B, S, H_local, D]:
                         weights replicated, the input taken as sharded on the heads (dim
                         2), so the weight gradient sums the TP ranks' heads
    colwise_norm         the weight of a norm over a colwise projection's whole output (OLMo 2's
                         QK-norm over every head at once): split like the projection's rows,
                         inputs and outputs left local ([B, S, F_local]); the norm reads the
                         TP mesh from its weight and sums its squares over the ranks
                         (models/olmo2/model.py ``ProjectionNorm``)
    head_shared          an identity marking a replicated tensor that head-local (TP-sharded)
                         work consumes directly, not through a colwise projection: its
                         gradient is summed over the TP ranks (e.g. MLA's rotary key)
    moe                  a mixture-of-experts layer under sequence parallelism: it takes the
                         local sequence shard as a plain tensor and returns one (its tokens
                         are this rank's own; the routed experts are expert-parallel)
    moe_replicated       a per-token module inside an MoE layer (router gate, shared
                         experts): weights replicated on the TP mesh, run on the rank's own
                         tokens (dim 0), gradients summed over the TP ranks
    colwise_fused:N      colwise for an nn.Linear whose output rows are N equal blocks:
                         [all q; all k; all v] (nanoGPT's c_attn, LitGPT's qkv with as many
                         query groups as heads: "colwise_fused:3") or a fused
                         [gate; up] ("colwise_fused:2"). Each block is split on its own, so
                         rank r returns [q_r, k_r, v_r]: split it with ``.chunk(N, dim=-1)``.
                         The weight keeps the module's layout (a ``_StridedShard`` DTensor:
                         ``full_tensor()`` and a full state dict are the unsharded [q; k; v]).
                         A sharded checkpoint saves it replicated (the unsharded rows).
                         Limit: FSDP on top trains, but gives the weight placements that
                         no longer say where its rows are (``full_tensor()`` is out of
                         order): its checkpoints are refused (titan_lightning/checkpoint.py)
    head_params          a module of per-head parameters ([n_heads, ...]: gpt-oss's attention
                         sinks) sharded on dim 0 with the heads; it reads them as local tensors
    heads                not a module: an integer attribute that counts heads (below)

Every parameter of a sharded module becomes a DTensor on the TP mesh, norms included, so
one grad-norm and one optimizer path serve the whole model.

Float8 (torchao's Float8Linear, tensorwise recipe: ``apply_tp(float8=True)``): a colwise or
rowwise float8 linear takes torchao's Float8ColwiseParallel / Float8RowwiseParallel, and a
``prepare_block_input`` block whose linear children are all those takes PrepareFloat8ModuleInput
(with sequence parallelism the block input is cast once and all-gathered in float8). The same
layouts as the plain styles; anything else (the high-precision head, a block with a plain
linear, MLA's replicated projections) keeps the plain style.

Weights are not broadcast (``src_data_rank=None``): each rank shards the full weights it
holds. Build the model on the meta device, apply TP, then materialize it (the
layout-independent init gives every rank its own shard); or, for a user's module built
normally, build it with the same seed on every rank: its weights are kept, not re-initialized.

Head counts. Colwise projections give each rank 1/tp of the heads, so a module that
reshapes with a head count (``q.view(B, T, self.n_head, hs)``) must read the local count.
``apply_tp`` divides these integer attributes by tp, in place:

- found by name on every module that owns a colwise-sharded child (the attention) and on
  that module's ``config`` object: ``HEAD_COUNT_NAMES`` (n_head, n_heads, num_heads,
  num_attention_heads, n_kv_heads, n_kv_head, num_key_value_heads, n_query_groups,
  num_kv_heads), when they are plain instance attributes and the module's class reads them
  (its source names them: an MLP holding the model's config does not). A ``config`` shared
  by every block (LitGPT) is divided once, and only when every module that holds it and
  reads the count (but the root) has its projections sharded: an MLP-only plan leaves the
  attention's counts alone; a plan sharding some attention modules and not others that read
  the same config is refused before anything is sharded.
- declared in the plan with the style ``heads``: the pattern names a module, then
  attributes, e.g. ``"blocks.*.attn.n_head": "heads"`` or ``"config.n_head": "heads"``.

Nothing else is touched: hidden sizes (n_embd, dim), head sizes and ratios such as
``n_head // n_query_groups`` stay what they were (the ratio is the same locally). A shape
computed from a hidden size or from the input's last dim (``C // self.n_head``,
``split(self.n_embd)``) is still global: such a module fails under TP, and the error names
it (a module that owns sharded children re-raises a shape error of its forward as
``TensorParallelShapeError``, saying what to declare). What no check can see: a global head
count under a name of its own with -1 for the head size (``view(B, T, self.nh, -1)``) runs,
on heads of the wrong size; declare such a count.

Fused q, k, v projections. Rows stacked as [all q; all k; all v] (LitGPT's ``qkv``,
nanoGPT's ``c_attn``) need ``colwise_fused:3``: plain ``colwise`` would give rank 0 the q rows
and some k rows, and the forward would run, silently wrong. So plain ``colwise`` on a linear
whose output width is (heads + 2 x query groups) x head size of the attention owning it (the
counts and head size read by name from it or its ``config``, in a class that reads the head
count) is refused before anything is sharded; rows grouped per query group, which plain colwise
shards right, are declared ``colwise_grouped``. Under grouped-query attention the stacked blocks
are of unequal size ([q n_head*hs; k groups*hs; v groups*hs]), which ``colwise_fused`` (equal
blocks) cannot split: refused too, shard the MLP only (the attention stays whole on every rank).
"""

import functools
import inspect
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_lightning._compat import StridedShard as _StridedShard

from titan_lightning.config import ConfigError
from titan_lightning.parallel.contracts import ContractError
from titan_lightning.parallel.float8 import float8_tp_styles, is_float8_linear

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


def _post_norm(module: nn.Module, sp: bool, loss_parallel: bool) -> ParallelStyle:
    """A norm on a sublayer's output (Gemma's, OLMo 2's): ``norm``, but it returns the local tensor,
    as the rowwise projection before it would, to add to the residual."""
    return SequenceParallel(use_local_output=True) if sp else ReplicateParallel()


def _prepare_block_input(module: nn.Module, sp: bool, loss_parallel: bool,
                         prepare: type = PrepareModuleInput) -> Optional[ParallelStyle]:
    if not sp:
        return None  # the input is already a replicated local tensor, which colwise expects
    rest = (None,) * (_positional_arity(module) - 1)
    return prepare(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))


def _moe(module: nn.Module, sp: bool, loss_parallel: bool) -> ParallelStyle:
    if not sp:
        # Every TP rank would route the same tokens to the experts: their gradients would count
        # each token tp times. Checked before launch (config.validation); this is the backstop.
        raise ValueError("an MoE layer under tensor parallelism needs parallelism.sequence_parallel=True")
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)


def _moe_replicated(module: nn.Module, sp: bool, loss_parallel: bool) -> ParallelStyle:
    return SequenceParallel(sequence_dim=0, use_local_output=True)


def _output(module: nn.Module, sp: bool, loss_parallel: bool) -> ParallelStyle:
    return OutputParallel(
        input_layouts=_activation(sp),
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )


class OutputParallel(ColwiseParallel):
    """Colwise over the vocab for the LM head. A head that computes the loss itself from its
    vocab shard (a chunked loss: the model's ``Head`` given labels) returns a plain tensor,
    which passes through; logits are laid out as ``output_layouts`` says."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


class HeadShared(ParallelStyle):
    """Identity forward; in the backward, the gradient is summed over the TP ranks.

    Each rank's heads contribute part of the gradient of a tensor they all read; read as a
    Partial DTensor and redistributed to Replicate, the parts add up.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, _replicate_inputs, _partial_grad_output)


def _partial_grad_output(module: nn.Module, output, mesh: DeviceMesh):
    return output.to_local(grad_placements=[Partial()]) if isinstance(output, DTensor) else output


class ColwiseNormParallel(ParallelStyle):
    """Every parameter split on dim 0 like a colwise projection's rows; inputs and outputs untouched."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _shard_rows)


def _shard_rows(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param, mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))


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


class FusedColwiseParallel(ColwiseParallel):
    """Colwise for an nn.Linear whose output rows are ``parts`` equal blocks ([q; k; v]).

    Each block is split over the ranks on its own (``_StridedShard(0, split_factor=parts)``):
    rank r computes [q_r, k_r, v_r] and returns it as a local tensor.
    """

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        placement = _StridedShard(0, split_factor=self.parts)
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()  # already each block's rank-local part, in block order


class HeadParams(ParallelStyle):
    """Every parameter of the module sharded on dim 0, one entry per query head (gpt-oss's
    attention sinks [n_heads]): each TP rank holds its heads' entries, which the module reads
    as a local tensor (``to_local()``); the gradients stay per head. No input or output hook."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        return module


FUSED = "colwise_fused"
HEADS = "heads"  # plan style of an integer attribute that counts heads (not a module)


STYLES: dict[str, StyleFactory] = {
    "embedding": _embedding,
    "colwise": _colwise,
    "colwise_grouped": _colwise,
    "rowwise": _rowwise,
    "norm": _norm,
    "post_norm": _post_norm,
    "prepare_block_input": _prepare_block_input,
    "output": _output,
    "replicate": lambda module, sp, loss_parallel: ReplicateParallel(),
    "colwise_norm": lambda module, sp, loss_parallel: ColwiseNormParallel(),
    "head_shared": lambda module, sp, loss_parallel: HeadShared(),
    "head_norm": lambda module, sp, loss_parallel: SequenceParallel(sequence_dim=2, use_local_output=True),
    "moe": _moe,
    "moe_replicated": _moe_replicated,
    "head_params": lambda module, sp, loss_parallel: HeadParams(),
}

# The weight dimension each style splits across the TP ranks (nn.Linear weights are [out, in]).
_SHARDED_WEIGHT_DIM = {"embedding": 0, "colwise": 0, "colwise_grouped": 0, "output": 0, "rowwise": 1, FUSED: 0,
                       "colwise_norm": 0}
# Styles whose output features are split: their module's owner holds 1/tp of the heads.
_HEAD_SPLITTING = ("colwise", "colwise_grouped", FUSED)
# Styles that make their owner's forward see local sizes (its shape errors are explained).
_SPLITTING = (*_HEAD_SPLITTING, "rowwise")
# What an attention module (or its config) calls its query heads and its key/value heads.
_QUERY_HEAD_NAMES = ("n_head", "n_heads", "num_heads", "num_attention_heads")
_KV_HEAD_NAMES = ("n_kv_heads", "n_kv_head", "num_key_value_heads", "n_query_groups", "num_kv_heads")
# Integer attributes that count heads, localized on the owners of colwise children and their ``config``.
HEAD_COUNT_NAMES = (*_QUERY_HEAD_NAMES, *_KV_HEAD_NAMES)
# Its head size and its width, for recognizing a fused q, k, v projection (``_check_fused_qkv``).
_HEAD_SIZE_NAMES = ("head_size", "head_dim")
_WIDTH_NAMES = ("n_embd", "dim", "hidden_size", "embed_dim")


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: dict[str, str],
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    float8: bool = False,
) -> nn.Module:
    """Shard ``model`` over the 1-D ``tp_mesh`` as ``plan`` says; the model is changed in place.

    The whole plan is checked (style names, patterns, divisible sizes and head counts) before
    anything is sharded. Head counts are then made per-rank (see the module docstring), and
    every module that owns sharded children explains a shape error of its forward. With
    ``loss_parallel`` the model returns vocab-sharded DTensor logits: compute the loss and run
    backward inside ``torch.distributed.tensor.parallel.loss_parallel()``. With ``float8``
    (torchao's float8 linears, tensorwise recipe) the float8 linears and the blocks that feed only
    them take torchao's float8 styles (``_float8_factories``).
    """
    tp = tp_mesh.size()
    resolved, heads = _checked_plan(model, plan, tp, sequence_parallel)
    float8_styles = _float8_factories(resolved) if float8 else {}
    for fqn, module, style in resolved:
        parallel_style = float8_styles.get(fqn, _factory(style))(module, sequence_parallel, loss_parallel)
        if parallel_style is not None:
            parallelize_module(module, tp_mesh, parallel_style, src_data_rank=None)
    for count in heads:
        setattr(count.owner, count.attr, count.value // tp)
    _explain_shape_errors(model, resolved, heads, tp)
    return model


def _float8_factories(resolved: list[tuple[str, nn.Module, str]]) -> dict[str, StyleFactory]:
    """The entries that take torchao's float8 styles (same layouts, parallel/float8.py), by fqn:
    a colwise or rowwise float8 linear, and a ``prepare_block_input`` block whose linear children
    are all such (its gathered input then meets float8 matmuls only: torchao casts it once, before
    the all-gather). Anything else, such as the high-precision head, keeps torch's style."""
    colwise, rowwise, prepare = float8_tp_styles()
    factories: dict[str, StyleFactory] = {
        "colwise": lambda module, sp, loss_parallel: colwise(),
        "rowwise": lambda module, sp, loss_parallel: rowwise(output_layouts=_activation(sp)),
        "prepare_block_input": lambda module, sp, loss_parallel: _prepare_block_input(module, sp, loss_parallel,
                                                                                       prepare),
    }
    factories["colwise_grouped"] = factories["colwise"]
    linears = {fqn for fqn, module, style in resolved
               if style in ("colwise", "colwise_grouped", "rowwise") and is_float8_linear(module)}

    def fed_float8_only(fqn: str, block: nn.Module) -> bool:
        children = [_join(fqn, name) for name, child in block.named_children() if isinstance(child, nn.Linear)]
        return bool(children) and set(children) <= linears

    blocks = {fqn for fqn, module, style in resolved if style == "prepare_block_input" and fed_float8_only(fqn, module)}
    return {fqn: factories[style] for fqn, _, style in resolved if fqn in linears | blocks}


def check_tp_plan(model: nn.Module, plan: dict[str, str], tp: int, *, sequence_parallel: bool) -> None:
    """Raise what ``apply_tp`` would raise about ``plan`` on ``model`` at degree ``tp``, changing
    nothing and needing no process group (for a check before launch)."""
    _checked_plan(model, plan, tp, sequence_parallel)


def _checked_plan(
    model: nn.Module, plan: dict[str, str], tp: int, sequence_parallel: bool
) -> tuple[list[tuple[str, nn.Module, str]], list["_HeadCount"]]:
    """The plan's (fqn, module, style) entries and the head counts to divide, all checked."""
    _check_sequence_parallel(plan, sequence_parallel)
    entries = [(pattern, fqn, module, style) for pattern, style in plan.items() if style != HEADS
               for fqn, module in _resolve(model, pattern, style)]
    for pattern, fqn, module, style in entries:
        _check_fused_qkv(model, pattern, fqn, module, style)  # (before: it explains an indivisible block size)
        _check_divisible(fqn, module, style, tp)
    resolved = [(fqn, module, style) for _, fqn, module, style in entries]
    return resolved, _head_counts(model, plan, resolved, tp)


def _parse_style(style: str) -> tuple[str, Optional[int]]:
    """``"colwise_fused:3"`` -> ("colwise_fused", 3); other styles have no argument."""
    name, colon, arg = style.partition(":")
    if name == FUSED and colon and arg.isdigit() and int(arg) >= 2:
        return name, int(arg)
    return (style, None) if style in STYLES or style == HEADS else ("", None)


def _factory(style: str) -> StyleFactory:
    name, parts = _parse_style(style)
    if name == FUSED:
        return lambda module, sp, loss_parallel: FusedColwiseParallel(parts)
    return STYLES[name]


def _resolve(model: nn.Module, pattern: str, style: str) -> list[tuple[str, nn.Module]]:
    name, _ = _parse_style(style)
    if not name:
        raise ValueError(
            f"TP plan entry {pattern!r}: unknown style {style!r}; valid styles are {', '.join(STYLES)}, "
            f"{FUSED}:N (N >= 2 equal blocks of output rows), {HEADS} (an integer attribute)"
        )
    matches, removed = _match(model, pattern)
    if not matches and not removed:
        raise ValueError(
            f"TP plan pattern {pattern!r} (style {style!r}) matches no module of {type(model).__name__}; "
            f"patterns are module names with '*' for one name part, e.g. 'layers.*.attention.wq'"
        )
    if name == FUSED:
        for fqn, module in matches:
            if not isinstance(module, nn.Linear):
                raise ValueError(f"TP style {style!r} shards an nn.Linear; {fqn} is a {type(module).__name__}")
    return matches


def _match(model: nn.Module, pattern: str, attributes: bool = False) -> tuple[list[tuple[str, Any]], int]:
    """Modules whose name matches ``pattern`` part by part, and how many matched slots are None.

    A None slot is a submodule a pipeline stage removed (``model.output = None``): it is
    skipped, not an error. With ``attributes``, a part that names no submodule may name a plain
    attribute (a config object), matched exactly.
    """
    frontier: list[tuple[str, Any]] = [("", model)]
    removed = 0
    for part in pattern.split(".") if pattern else []:
        found = []
        for fqn, obj in frontier:
            children = obj._modules if isinstance(obj, nn.Module) else {}  # named_children() hides None slots
            names = [name for name in children if fnmatchcase(name, part)]
            removed += sum(children[name] is None for name in names)
            found += [(_join(fqn, name), children[name]) for name in names if children[name] is not None]
            if attributes and not names and getattr(obj, part, None) is not None:
                found.append((_join(fqn, part), getattr(obj, part)))
        frontier = found
    return frontier, removed


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _check_divisible(fqn: str, module: nn.Module, style: str, tp: int) -> None:
    name, parts = _parse_style(style)
    dim = _SHARDED_WEIGHT_DIM.get(name)
    weight = getattr(module, "weight", None)
    if dim is None or weight is None:
        return
    size = weight.shape[dim] // (parts or 1)  # of each block
    if weight.shape[dim] % (tp * (parts or 1)):
        blocks = f" into {parts} blocks of {size}, each" if parts else ""
        raise ValueError(
            f"TP style {style!r} splits dim {dim} of {fqn}.weight {tuple(weight.shape)}{blocks}, "
            f"which is not divisible by parallelism.tp={tp}; choose a tp degree that divides {size}"
        )


def _check_sequence_parallel(plan: dict[str, str], sequence_parallel: bool) -> None:
    """Under sequence parallelism a rowwise layer returns the hidden states sharded on the
    sequence: something must carry them (a sharded embedding, norms, gathered block inputs)."""
    styles = {_parse_style(style)[0] for style in plan.values()}
    if sequence_parallel and "rowwise" in styles and not styles & {"embedding", "norm", "prepare_block_input"}:
        raise ConfigError(
            "parallelism.sequence_parallel=True, but the TP plan has rowwise layers (which then return the hidden "
            "states sharded on the sequence) and no 'embedding', 'norm' or 'prepare_block_input' entries to carry "
            "them; declare those (see titan_lightning/parallel/tensor.py) or set parallelism.sequence_parallel=False"
        )


# -- head counts ------------------------------------------------------------------------------


@dataclass
class _HeadCount:
    label: str  # where it is, from the model: "blocks.0.attn.config.n_head"
    owner: Any  # the module or config object holding it
    attr: str
    value: int


def _head_counts(model: nn.Module, plan: dict[str, str], resolved: list, tp: int) -> list[_HeadCount]:
    """The head counts to divide by tp: declared ones, then those found by name; each object's
    attribute once (a config shared by every block is one object)."""
    found: dict[tuple[int, str], _HeadCount] = {}
    candidates = [match for pattern, style in plan.items() if style == HEADS
                  for match in _resolve_heads(model, pattern)]
    owners = _owners(model, resolved, _HEAD_SPLITTING)
    for fqn, owner in owners.items():
        for prefix, obj in ((fqn, owner), (_join(fqn, "config"), getattr(owner, "config", None))):
            attributes = vars(obj) if obj is not None and hasattr(obj, "__dict__") else {}
            # Instance attributes only: a property or an alias (HF's attribute_map) is not a count of its own.
            candidates += [(_join(prefix, name), obj, name) for name in HEAD_COUNT_NAMES
                           if _is_count(attributes.get(name)) and _reads(owner, name)]
    for label, obj, attr in candidates:
        found.setdefault((id(obj), attr), _HeadCount(label, obj, attr, getattr(obj, attr)))
    for count in found.values():
        _check_shared(model, count, owners)
        if count.value % tp:
            raise ConfigError(
                f"tensor parallelism gives each of parallelism.tp={tp} ranks 1/{tp} of the heads, but "
                f"{count.label}={count.value} is not divisible by {tp}; choose a tp that divides {count.value}"
            )
        try:
            setattr(count.owner, count.attr, count.value)  # the same value: can it be set at all?
        except AttributeError as error:
            raise ContractError(f"{count.label} counts heads and must become {count.value // tp} under "
                                f"parallelism.tp={tp}, but it cannot be set: {error}") from error
    return list(found.values())


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_shared(model: nn.Module, count: _HeadCount, owners: dict[str, nn.Module]) -> None:
    """A count on an object other modules hold too (LitGPT's one ``Config``) becomes per-rank for
    all of them: refused unless every submodule holding it whose class reads the count owns
    head-sharded projections (the root, which only holds the model, does not count)."""
    if isinstance(count.owner, nn.Module):
        return
    holders = [(fqn, module) for fqn, module in model.named_modules()
               if fqn and any(value is count.owner for value in vars(module).values())]
    whole = [f"{fqn} ({type(module).__name__})" for fqn, module in holders
             if fqn not in owners and _reads(module, count.attr)]
    if whole:
        more = f" and {len(whole) - 3} more" if len(whole) > 3 else ""
        raise ContractError(
            f"{count.label} counts heads and the tp_plan shards heads of modules that read it, but the same "
            f"{type(count.owner).__name__} object is read by {', '.join(whole[:3])}{more}, which the plan does not "
            f"shard: made per-rank, it would be wrong there; shard the projections of every module that reads it, or "
            f"none of them (and declare no 'heads' on it)"
        )


def _reads(module: nn.Module, name: str) -> bool:
    """Whether the class of ``module`` (its own code and its bases', torch's excepted) names
    ``name``; True when that code cannot be read."""
    names = _names_in_source(type(module))
    return names is None or name in names


@functools.cache
def _names_in_source(cls: type) -> Optional[frozenset[str]]:
    names: set[str] = set()
    for base in cls.__mro__:
        if base is object or base.__module__.split(".")[0] == "torch":
            continue
        try:
            names.update(re.findall(r"\w+", inspect.getsource(base)))
        except (OSError, TypeError):
            return None
    return frozenset(names)


# -- fused q, k, v projections ----------------------------------------------------------------


def _check_fused_qkv(model: nn.Module, pattern: str, fqn: str, module: nn.Module, style: str) -> None:
    """Refuse a colwise style that would give a rank the wrong rows of a fused q, k, v projection,
    where the layout can be known: the linear's output width is (heads + 2 x query groups) x head
    size of the attention owning it, and that attention's class reads its head count."""
    name, parts = _parse_style(style)
    if name not in ("colwise", FUSED) or not isinstance(module, nn.Linear):
        return
    owner_fqn = fqn.rpartition(".")[0]
    owner = model.get_submodule(owner_fqn)
    sizes = _attention_sizes(owner)
    if sizes is None:
        return
    heads, groups, head_size, head_name = sizes
    if module.out_features != (heads + 2 * groups) * head_size or not _reads(owner, head_name):
        return
    if name == FUSED and parts == 3 and heads == groups:
        return
    where = (f"{fqn} ({module.out_features} output rows: ({heads} heads + 2 x {groups} query groups) x head size "
             f"{head_size}, as {owner_fqn or 'the model'} ({type(owner).__name__}) declares)")
    if heads == groups:
        fix = f"use '{FUSED}:3' (rank r computes [q_r; k_r; v_r])"
    else:
        fix = (f"under grouped-query attention its blocks are of unequal size (q {heads * head_size} rows, k and v "
               f"{groups * head_size} each), which '{FUSED}' (equal blocks) cannot split: leave "
               f"{owner_fqn or 'the attention'}'s projections out of tp_plan and shard the MLP only")
    raise ContractError(
        f"tp_plan entry {pattern!r}: style {style!r} on {where} would give each rank the wrong rows where they are "
        f"stacked [all q; all k; all v] (LitGPT's qkv, nanoGPT's c_attn): {fix}; rows grouped per query group "
        f"([q; k; v] of group 0, then of group 1, ...: GPT-NeoX, Falcon) are sharded right by 'colwise_grouped'"
    )


def _attention_sizes(owner: nn.Module) -> Optional[tuple[int, int, int, str]]:
    """(query heads, key/value heads, head size, the head count's name) that a module or its
    ``config`` declares by the usual names; None where it declares no head count."""
    def first(names: tuple[str, ...]) -> tuple[Optional[int], str]:
        for obj in (owner, getattr(owner, "config", None)):
            for name in names:
                value = getattr(obj, name, None) if obj is not None else None
                if _is_count(value) and value > 0:
                    return value, name
        return None, ""

    heads, head_name = first(_QUERY_HEAD_NAMES)
    if heads is None:
        return None
    groups = first(_KV_HEAD_NAMES)[0] or heads
    head_size = first(_HEAD_SIZE_NAMES)[0]
    if head_size is None:
        width = first(_WIDTH_NAMES)[0]
        head_size = width // heads if width is not None and width % heads == 0 else None
    return None if head_size is None else (heads, groups, head_size, head_name)


def _resolve_heads(model: nn.Module, pattern: str) -> list[tuple[str, Any, str]]:
    """(label, object, attribute) for a ``heads`` entry: module names (``*`` for one part),
    then plain attributes (a config object), then the integer attribute."""
    path, _, attr = pattern.rpartition(".")
    frontier, removed = _match(model, path, attributes=True)
    matches = [(_join(fqn, attr), obj, attr) for fqn, obj in frontier if hasattr(obj, attr)]
    if not matches and not removed:
        raise ValueError(
            f"TP plan entry {pattern!r} (style {HEADS!r}) matches no attribute of {type(model).__name__}; name a "
            f"module ('*' for one name part), then the integer attribute: 'blocks.*.attn.n_head' or 'config.n_head'"
        )
    for label, obj, name in matches:
        if not _is_count(getattr(obj, name)):
            raise ValueError(f"TP plan entry {pattern!r} (style {HEADS!r}): {label} is {getattr(obj, name)!r}, "
                             f"not an integer head count")
    return matches


def _owners(model: nn.Module, resolved: list, styles: tuple[str, ...]) -> dict[str, nn.Module]:
    """The modules that own a child sharded with one of ``styles`` (an attention, an MLP), by fqn."""
    owners: dict[str, nn.Module] = {}
    for fqn, _, style in resolved:
        if _parse_style(style)[0] in styles:
            parent = fqn.rpartition(".")[0]
            owners.setdefault(parent, model.get_submodule(parent))
    return owners


# -- naming the module whose reshape fails ------------------------------------------------------


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


def _explain_shape_errors(model: nn.Module, resolved: list, heads: list[_HeadCount], tp: int) -> None:
    sharded: dict[str, list[str]] = {}
    for fqn, _, style in resolved:
        if _parse_style(style)[0] in _SPLITTING:
            parent, _, name = fqn.rpartition(".")
            sharded.setdefault(parent, []).append(f"{name}: {style}")
    for fqn, owner in _owners(model, resolved, _SPLITTING).items():
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


def _positional_arity(module: nn.Module) -> int:
    """How many positional inputs ``module.forward`` takes (PrepareModuleInput needs one layout each)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in inspect.signature(module.forward).parameters.values())
