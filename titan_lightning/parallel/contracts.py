"""What ``parallel/`` and the strategies read of a model and of a LightningModule, declared once.

``parallel/`` never imports a model: it finds the parts it shards by the names below, and a model
(ours, or a user's own) that wants a parallelism declares them. The strategy reads the
LightningModule's side (``TitanModule``) and hands the module the strategy's (``TitanStrategyView``).
``check_contracts`` checks a module against the degrees it runs with, once, where the strategy first
sees it (``TitanStrategy.check_module``, before launch); the functions that find the parts
(``attention_modules``, ``grouped_experts``, ``moe_layers``, ``pipeline_layers``) say the same
one line when ``parallel/`` applies a parallelism to a model built later (ours: on the meta device
at setup). A missing part is a ``ContractError``: one line naming the attribute and what needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union, runtime_checkable

from torch import Tensor, nn

from titan_lightning.config import ConfigError, ParallelismConfig
from titan_lightning.config.job import CP_ATTENTIONS


class ContractError(ConfigError):
    """A module lacks what a parallelism needs of it (the attribute, and what needs it). A kind of
    ConfigError: the command line reports it in one line, exit status 2 before launch."""


# -- what a model declares ---------------------------------------------------------------


@runtime_checkable
class Blocks(Protocol):
    """FSDP, activation checkpointing and compile wrap each block (fsdp.model_blocks): ``layers``,
    in order; a model without it has its repeated blocks found instead."""

    layers: Union[nn.ModuleDict, nn.ModuleList]


@runtime_checkable
class CPAttention(Protocol):
    """Context parallelism hands every attention module the CP group (context.apply_context_parallel)."""

    backend: str  # one of CP_ATTENTIONS under CP
    cp: Any  # None; the ContextParallel once applied


@runtime_checkable
class GroupedExperts(Protocol):
    """Expert parallelism shards stacked expert weights along dim 0 (expert.apply_expert_parallel)."""

    routed_experts: bool  # True: the marker grouped_experts looks for
    num_experts: int
    w1: Tensor  # [num_experts, hidden, dim]
    w2: Tensor  # [num_experts, dim, hidden]
    w3: Tensor  # [num_experts, hidden, dim]
    ep: Any  # None; the ExpertParallel once applied


@runtime_checkable
class MoELayer(Protocol):
    """Expert tensor parallelism and compile find a MoE layer by ``moe_layer`` (expert.moe_layers)."""

    moe_layer: bool  # True: the marker
    experts: GroupedExperts
    etp: Any  # None; the expert-TP group once applied


@dataclass(frozen=True)
class PipelinePlan:
    """Where a LightningModule's model keeps what a pipeline splits (parallel/pipeline.py splits it).

    ``model``: the LightningModule attribute holding the model; ``layers``: the model's
    ModuleDict of blocks, run in order; ``first`` / ``last``: modules that run before / after
    the blocks (the first / last stage keeps them, the others set them to None, and the
    model's forward must skip a None module and then take / return hidden states).
    """

    model: str = "model"
    layers: str = "layers"
    first: tuple[str, ...] = ("tok_embeddings",)
    last: tuple[str, ...] = ("norm", "output")


@runtime_checkable
class PipelineModel(Protocol):
    """The model a PipelinePlan splits: its ``plan.layers`` ModuleDict of blocks run in order, and
    ``plan.first`` / ``plan.last`` submodules (tok_embeddings; norm, output by default) that its
    forward skips when they are None."""

    layers: nn.ModuleDict


# -- what a LightningModule declares to the strategy, and what it may read of it ---------


@runtime_checkable
class TitanModule(Protocol):
    """What TitanStrategy reads of a LightningModule; every attribute optional (getattr), each
    needed by one feature: ``job`` (a JobConfig: the degrees, precision and seeds; else the
    strategy's own), ``tp_plan`` (parallelism.tp > 1 without a configure_model of its own),
    ``pipeline_plan`` (parallelism.pp > 1), ``model`` + ``materialize(device)`` (a module that
    builds its model on the meta device and initializes it after sharding)."""

    job: Any
    tp_plan: Optional[dict[str, str]]
    pipeline_plan: Optional[PipelinePlan]
    model: Optional[nn.Module]

    def materialize(self, device: Any) -> None: ...


@runtime_checkable
class TitanStrategyView(Protocol):
    """What a LightningModule may read of its strategy (``self.trainer.strategy``)."""

    materializes_model: bool  # True: leave the model on the meta device, the strategy materializes it
    pipeline: Any  # the PipelineRunner under PP, else None


# -- finding the parts --------------------------------------------------------------------


def attention_modules(model: nn.Module, cp: int) -> list[nn.Module]:
    """The CPAttention modules of ``model``, all of one context-parallel backend."""
    modules = [m for m in model.modules() if hasattr(m, "backend") and hasattr(m, "cp")]
    if not modules:
        raise ContractError(f"parallelism.cp={cp}: {type(model).__name__} has no attention module that can do CP")
    backends = sorted({m.backend for m in modules})
    non_cp = [b for b in backends if b not in CP_ATTENTIONS]
    if non_cp:
        raise ContractError(
            f"parallelism.cp={cp} but the model has attention {non_cp[0]!r}, which cannot do CP; "
            f"apply ContextParallelTransform(attention=...) with one of {', '.join(CP_ATTENTIONS)}"
        )
    if len(backends) > 1:
        raise ContractError(f"one model mixes the context-parallel attentions {backends}; use one backend")
    return modules


def grouped_experts(model: nn.Module) -> list[nn.Module]:
    """Every GroupedExperts module of ``model`` (models/common/moe.py GroupedExperts)."""
    return [m for m in model.modules() if getattr(m, "routed_experts", False)]


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """Every MoELayer module of ``model`` (models/common/moe.py MoE)."""
    return [m for m in model.modules() if getattr(m, "moe_layer", False)]


def expert_modules(model: nn.Module, ep: int) -> list[nn.Module]:
    """The GroupedExperts that ``parallelism.ep`` shards; there must be some."""
    modules = grouped_experts(model)
    if not modules:
        raise ContractError(f"parallelism.ep={ep}: {type(model).__name__} has no MoE layer to shard")
    return modules


def pipeline_model(module: nn.Module, plan: PipelinePlan) -> nn.Module:
    """The model a PipelinePlan names on ``module``, built."""
    model = getattr(module, plan.model, None)
    if model is None:
        raise ContractError(f"pipeline plan: {type(module).__name__}.{plan.model} is None; build the model first")
    return model


def pipeline_layers(model: nn.Module, plan: PipelinePlan) -> nn.ModuleDict:
    """The model's blocks a PipelinePlan splits; the plan's first and last modules exist."""
    layers = getattr(model, plan.layers, None)
    if not isinstance(layers, nn.ModuleDict):
        raise ContractError(
            f"pipeline parallelism needs {type(model).__name__}.{plan.layers} to be an nn.ModuleDict of blocks "
            f"(found {type(layers).__name__}); see PipelinePlan"
        )
    for name in (*plan.first, *plan.last):
        if not hasattr(model, name):
            raise ContractError(f"pipeline plan names {type(model).__name__}.{name}, which does not exist")
    return layers


def check_contracts(module: nn.Module, p: ParallelismConfig, *, built: bool) -> None:
    """Before launch: ``module`` declares what ``p``'s degrees need of it and, when its network
    is ``built`` already (a user's module without ``materialize`` or a configure_model of its own),
    has the parts they shard. A module that builds its model at setup is checked by the same
    functions when ``parallel/`` applies each parallelism."""
    if p.pp > 1 and getattr(module, "pipeline_plan", None) is None:
        raise ContractError(
            f"parallelism.pp={p.pp} needs a pipeline plan, and {type(module).__name__} declares none: give it a "
            f"`pipeline_plan = PipelinePlan(model=..., layers=..., first=..., last=...)` attribute "
            f"(see titan_lightning/parallel/contracts.py)"
        )
    if not built:
        return
    if p.pp > 1 and getattr(module, module.pipeline_plan.model, None) is not None:
        pipeline_layers(pipeline_model(module, module.pipeline_plan), module.pipeline_plan)
    if p.cp > 1:
        attention_modules(module, p.cp)
    if p.ep > 1:
        expert_modules(module, p.ep)
