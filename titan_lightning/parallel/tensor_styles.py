"""The tensor-parallel styles a plan may name: one ``TPStyle`` record per style, in ``STYLES``.

A record says everything the rest of tensor parallelism asks about its style: what it does
(``description``, the table below is built from it), torch's ``ParallelStyle`` for a module
(``parallel_style``), the weight dimension it splits (checked divisible before sharding), whether
it splits a module's output features (its owner then holds 1/tp of the heads: head counts are
made per-rank) or its input features (its owner's forward sees per-rank sizes: its shape errors
are explained), and torchao's float8 form, if any (``float8``, for a torchao float8 linear under
the tensorwise recipe).

To add a style, add one record to ``STYLES``: nothing else names it. A factory is given the
module (``Target``), so a style can shard a module's children with it: a linear with low-rank
adapters ``lora_a`` / ``lora_b`` under colwise takes A replicated and B colwise (the update is
split like the base's output), under rowwise A rowwise and B replicated (its partial sums are
reduced with the base's), in a ``ParallelStyle`` whose ``_apply`` shards each child; the record
keeps colwise's (or rowwise's) weight dim and head splitting. ``colwise``, ``colwise_grouped``,
``colwise_fused``, ``rowwise`` and ``moe_replicated`` do so (``_adapted``: where the entry's module
has adapters, ``AdaptedLinearParallel`` over the base's style).

Weights are not broadcast (``src_data_rank=None``): each rank shards the full weights it holds.
Every parameter of a sharded module becomes a DTensor on the TP mesh, norms included, so one
grad-norm and one optimizer path serve the whole model.

The styles:

"""

import inspect
import textwrap
from dataclasses import dataclass
from typing import Callable, Optional

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
)

from titan_lightning._compat import StridedShard as _StridedShard

from titan_lightning.parallel.float8 import float8_tp_styles


@dataclass(frozen=True)
class Target:
    """What a style is applied to: the module, the run's TP options, and the entry's argument."""

    module: nn.Module
    sequence_parallel: bool
    loss_parallel: bool
    parts: Optional[int] = None  # N of 'colwise_fused:N'


# Target -> the ParallelStyle to apply to its module, or None for nothing.
StyleFactory = Callable[[Target], Optional[ParallelStyle]]


@dataclass(frozen=True)
class TPStyle:
    """One style of a TP plan."""

    name: str
    description: str
    parallel_style: Optional[StyleFactory]  # None: the entry names an attribute, not a module
    sharded_weight_dim: Optional[int] = None  # of ``module.weight`` (nn.Linear weights are [out, in])
    splits_heads: bool = False  # output features split: the owner holds 1/tp of the heads
    splits_inputs: bool = False  # input features split: the owner's forward sees per-rank sizes
    float8: Optional[StyleFactory] = None  # torchao's form for a float8 linear (tensorwise recipe)
    argument: str = ""  # after 'name:' an integer >= 2, spelled so in messages: 'N (N >= 2 equal blocks ...)'

    @property
    def splitting(self) -> bool:
        """Whether the module's owner computes on per-rank sizes."""
        return self.splits_heads or self.splits_inputs

    @property
    def spelling(self) -> str:
        """How a plan names it, as messages write it."""
        if self.parallel_style is None:
            return f"{self.name} (an integer attribute)"
        return f"{self.name}:{self.argument}" if self.argument else self.name


def _activation(sequence_parallel: bool) -> Placement:
    """Layout of the residual stream between blocks."""
    return Shard(1) if sequence_parallel else Replicate()


def _norm(t: Target) -> ParallelStyle:
    return SequenceParallel() if t.sequence_parallel else ReplicateParallel()


def _post_norm(t: Target) -> ParallelStyle:
    """``norm``, but it returns the local tensor, as the rowwise projection before it would, to add to the residual."""
    return SequenceParallel(use_local_output=True) if t.sequence_parallel else ReplicateParallel()


def _prepare_block_input(t: Target, prepare: type = PrepareModuleInput) -> Optional[ParallelStyle]:
    if not t.sequence_parallel:
        return None  # the input is already a replicated local tensor, which colwise expects
    rest = (None,) * (_positional_arity(t.module) - 1)
    return prepare(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))


def _moe(t: Target) -> ParallelStyle:
    if not t.sequence_parallel:
        # Every TP rank would route the same tokens to the experts: their gradients would count
        # each token tp times. Checked before launch (config.validation); this is the backstop.
        raise ValueError("an MoE layer under tensor parallelism needs parallelism.sequence_parallel=True")
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)


def _output(t: Target) -> ParallelStyle:
    return OutputParallel(
        input_layouts=_activation(t.sequence_parallel),
        output_layouts=Shard(-1) if t.loss_parallel else Replicate(),
        use_local_output=not t.loss_parallel,
    )


def _positional_arity(module: nn.Module) -> int:
    """How many positional inputs ``module.forward`` takes (PrepareModuleInput needs one layout each)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in inspect.signature(module.forward).parameters.values())


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


class HeadParams(ParallelStyle):
    """Every parameter of the module sharded on dim 0, one entry per query head (gpt-oss's
    attention sinks [n_heads]): each TP rank holds its heads' entries, which the module reads
    as a local tensor (``to_local()``); the gradients stay per head. No input or output hook."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _shard_rows("", module, device_mesh)
        return module


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


def _float8_colwise(t: Target) -> ParallelStyle:
    return float8_tp_styles().colwise()


ADAPTERS = ("lora_a", "lora_b")  # a linear's low-rank adapters (titan_lightning/lora/layer.py LoRALinear)


class AdaptedLinearParallel(ParallelStyle):
    """``base``'s style on a linear with low-rank adapters, children ``lora_a`` [r, in] and ``lora_b``
    [out, r]: the base's weight, input and output as ``base`` lays them out, A and B as ``placements``
    say. Under colwise A is replicated and B split on its rows like the base's (the update is split
    like the base's output); under rowwise A is split on its columns like the base's (its output,
    partial sums, is reduced with the base's) and B replicated. B's input keeps a local boundary, as
    a colwise linear's does: its gradient is summed over the ranks there, A's stays replicated."""

    def __init__(self, base: ParallelStyle, a: Placement, b: Placement) -> None:
        super().__init__()
        self.base, self.placements = base, (a, b)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        children = dict(module._modules)  # (the adapters and their dropout) the base's style sees the linear alone
        module._modules.clear()
        try:
            self.base.src_data_rank = self.src_data_rank
            self.base._apply(module, device_mesh)
        finally:
            module._modules.update(children)
        for name, placement in zip(ADAPTERS, self.placements):
            if name not in children:
                continue  # (an A another layer holds and places: the parts of a fused linear, LoRALinear.share_a)
            child = children[name]
            weight = child.weight
            child.register_parameter("weight", nn.Parameter(
                distribute_tensor(weight, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=weight.requires_grad))
        children["lora_b"].register_forward_pre_hook(lambda mod, inputs: tuple(_local_boundary(x) for x in inputs))
        return module


def _local_boundary(x):
    """B's input replicated: A's partial sums reduced (rowwise: r features a token), or a replicated
    one as it is, its gradient's partial sums reduced (colwise): A's and B's gradients replicated."""
    if not isinstance(x, DTensor):
        return x
    if any(p.is_partial() for p in x.placements):
        return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return DTensor.from_local(x.to_local(), x.device_mesh, x.placements, run_check=False)


def _adapted(style: Callable[[Target], ParallelStyle],
             placements: Callable[[Target], tuple[Placement, Placement]]) -> StyleFactory:
    """``style``, or on a linear with adapters ``AdaptedLinearParallel`` over it with A and B placed
    as ``placements`` says: chosen by the module."""
    def factory(t: Target) -> ParallelStyle:
        base = style(t)
        return AdaptedLinearParallel(base, *placements(t)) if all(hasattr(t.module, n) for n in ADAPTERS) else base
    return factory


FUSED = "colwise_fused"
HEADS = "heads"  # plan style of an integer attribute that counts heads (not a module)
_COLWISE = dict(parallel_style=_adapted(lambda t: ColwiseParallel(), lambda t: (Replicate(), Shard(0))),
                sharded_weight_dim=0, splits_heads=True, float8=_float8_colwise)

STYLES: dict[str, TPStyle] = {style.name: style for style in (
    TPStyle("embedding", "rows of the table (vocab); the output is replicated, or sharded on the sequence with "
            "sequence parallelism",
            lambda t: RowwiseParallel(input_layouts=Replicate(), output_layouts=_activation(t.sequence_parallel)),
            sharded_weight_dim=0),
    TPStyle("colwise", "output features; the input is replicated, the output stays local", **_COLWISE),
    TPStyle("colwise_grouped", "colwise, for a fused projection whose rows are grouped per head or per query group "
            "([q; k; v] of group 0, then of group 1, ...: GPT-NeoX, Falcon): each rank gets whole groups. Plain "
            "'colwise' on a fused qkv is refused (parallel/tensor_plan_check.py): the name says the rows are grouped",
            **_COLWISE),
    TPStyle("rowwise", "input features; the output is all-reduced (replicated), or reduce-scattered on the sequence "
            "with sequence parallelism",
            _adapted(lambda t: RowwiseParallel(output_layouts=_activation(t.sequence_parallel)),
                     lambda t: (Shard(1), Replicate())), sharded_weight_dim=1,
            splits_inputs=True,
            float8=lambda t: float8_tp_styles().rowwise(output_layouts=_activation(t.sequence_parallel))),
    TPStyle("norm", "replicated weights; with sequence parallelism it runs on the local sequence shard, without it "
            "on the whole (replicated) sequence", _norm),
    TPStyle("post_norm", "a norm on a sublayer's output before the residual add (Gemma's norms after attention and "
            "the feed-forward, OLMo 2's post-norms): as norm, its output a local tensor like the residual stream's",
            _post_norm),
    TPStyle("prepare_block_input", "with sequence parallelism: all-gathers the first input (the hidden states) of "
            "an attention or feed-forward module before its colwise projections; the other inputs (RoPE tables, "
            "masks) pass through", _prepare_block_input,
            float8=lambda t: _prepare_block_input(t, float8_tp_styles().prepare_input)),
    TPStyle("output", "the LM head, colwise over the vocab; the logits come back whole, or stay a vocab-sharded "
            "DTensor for loss parallelism; a head that computes the loss itself (chunked) returns it as a plain "
            "tensor", _output, sharded_weight_dim=0),
    TPStyle("replicate", "replicated weights on the replicated (whole-sequence) input, with or without sequence "
            "parallelism (e.g. MLA's low-rank projections and their norms, inside the attention after the sequence "
            "all-gather)", lambda t: ReplicateParallel()),
    TPStyle("colwise_norm", "the weight of a norm over a colwise projection's whole output (OLMo 2's QK-norm over "
            "every head at once): split like the projection's rows, inputs and outputs left local ([B, S, "
            "F_local]); the norm reads the TP mesh from its weight and sums its squares over the ranks "
            "(models/olmo2/model.py ``ProjectionNorm``)", lambda t: ColwiseNormParallel(), sharded_weight_dim=0),
    TPStyle("head_shared", "an identity marking a replicated tensor that head-local (TP-sharded) work consumes "
            "directly, not through a colwise projection: its gradient is summed over the TP ranks (e.g. MLA's "
            "rotary key)", lambda t: HeadShared()),
    TPStyle("head_norm", "a norm over each head's features (QK-norm) on [B, S, H_local, D]: weights replicated, the "
            "input taken as sharded on the heads (dim 2), so the weight gradient sums the TP ranks' heads",
            lambda t: SequenceParallel(sequence_dim=2, use_local_output=True)),
    TPStyle("moe", "a mixture-of-experts layer under sequence parallelism: it takes the local sequence shard as a "
            "plain tensor and returns one (its tokens are this rank's own; the routed experts are expert-parallel)",
            _moe),
    TPStyle("moe_replicated", "a per-token module inside an MoE layer (router gate, shared experts): weights "
            "replicated on the TP mesh, run on the rank's own tokens (dim 0), gradients summed over the TP ranks",
            _adapted(lambda t: SequenceParallel(sequence_dim=0, use_local_output=True),
                     lambda t: (Replicate(), Replicate()))),
    TPStyle("head_params", "a module of per-head parameters ([n_heads, ...]: gpt-oss's attention sinks) sharded on "
            "dim 0 with the heads; it reads them as local tensors", lambda t: HeadParams()),
    TPStyle(FUSED, "colwise for an nn.Linear whose output rows are N equal blocks: [all q; all k; all v] "
            "(nanoGPT's c_attn, LitGPT's qkv with as many query groups as heads: 'colwise_fused:3') or a fused "
            "[gate; up] ('colwise_fused:2'). Each block is split on its own, so rank r returns [q_r, k_r, v_r]: "
            "split it with ``.chunk(N, dim=-1)``. The weight keeps the module's layout (a ``_StridedShard`` "
            "DTensor: ``full_tensor()`` and a full state dict are the unsharded [q; k; v]). A sharded checkpoint "
            "saves it replicated (the unsharded rows). Limit: FSDP on top trains, but gives the weight placements "
            "that no longer say where its rows are (``full_tensor()`` is out of order): refused before launch "
            "(config/validation.py), and such checkpoints are refused (checkpoint/placements.py)",
            _adapted(lambda t: FusedColwiseParallel(t.parts),
                     lambda t: (Replicate(), _StridedShard(0, split_factor=t.parts))),
            sharded_weight_dim=0, splits_heads=True,
            argument="N (N >= 2 equal blocks of output rows)"),
    TPStyle(HEADS, "not a module: an integer attribute that counts heads (parallel/tensor_plan_check.py)", None),
)}


def parse_style(style: str) -> tuple[Optional[TPStyle], Optional[int]]:
    """``"colwise_fused:3"`` -> (the colwise_fused record, 3); other styles have no argument;
    (None, None) for a name that is no style."""
    name, colon, arg = style.partition(":")
    record = STYLES.get(name)
    if record is not None and record.argument:
        return (record, int(arg)) if colon and arg.isdigit() and int(arg) >= 2 else (None, None)
    return (record, None) if record is not None and not colon else (None, None)


def valid_styles() -> str:
    """Every style's spelling, for an error message."""
    return ", ".join(style.spelling for style in STYLES.values())


__doc__ += "\n".join(textwrap.fill(style.description, 100, initial_indent=f"    {style.spelling}: ",
                                   subsequent_indent=" " * 8) for style in STYLES.values()) + "\n"
