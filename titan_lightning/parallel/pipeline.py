"""Pipeline parallelism (PP): where a model is cut into stages and which rank holds which.

The model is cut into ``pp * stages_per_rank`` stages along its blocks; each pipeline rank
keeps its stages (``loop`` placement: stage s on rank s % pp; ``v``: rank r holds stages r
and 2*pp-1-r). Each rank keeps one model (``module.model``) that holds its stages' modules
under their unsplit names (``layers.5`` stays ``layers.5``): state dicts, checkpoints and the
name-seeded init are those of the whole model. Each stage is a *view*: a module of the
model's own class that shares those submodules and lists only its stage's blocks.

Running the stages inside Lightning's loop (schedules, ``training_step`` unchanged, logged
values averaged over microbatches): the strategy's ``PipelineRunner`` (strategies/pipeline.py).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from titan_lightning.config import ConfigError, ParallelismConfig, TrainingConfig
from titan_lightning.config.parallelism import V_PP_SCHEDULES
from titan_lightning.config.validation import validate_stage_count
# PipelinePlan lives with the contracts; users import it from here too.
from titan_lightning.parallel.contracts import PipelinePlan, pipeline_layers, pipeline_model


# -- split points ------------------------------------------------------------------------


def split_layers(
    n_layers: int, num_stages: int, *, first_weight: int = 1, last_weight: int = 1
) -> list[list[int]]:
    """Layer indices of each stage, balanced with the first/last modules weighted like layers.

    The ``n_layers + first_weight + last_weight`` units are dealt out as evenly as possible
    (the earlier stages take one more when they do not divide); the first stage's share
    includes its ``first_weight`` units, the last stage's its ``last_weight``. A stage may end
    up with no block (it then runs only the head, say); never more stages than layers.
    """
    if not 1 <= num_stages <= n_layers:  # (a run's stages are checked by config.validation.validate_stage_count)
        raise ValueError(f"split_layers: num_stages={num_stages} must be in [1, n_layers={n_layers}]")
    units = n_layers + first_weight + last_weight
    base, extra = divmod(units, num_stages)
    shares = [base + (1 if s < extra else 0) for s in range(num_stages)]
    counts = list(shares)
    counts[0] -= first_weight
    counts[-1] -= last_weight
    # A weight larger than its stage's share: that stage runs no block, the deficit moves on.
    for s in range(num_stages - 1):
        if counts[s] < 0:
            counts[s + 1] += counts[s]
            counts[s] = 0
    for s in range(num_stages - 1, 0, -1):
        if counts[s] < 0:
            counts[s - 1] += counts[s]
            counts[s] = 0
    result, start = [], 0
    for count in counts:
        result.append(list(range(start, start + count)))
        start += count
    assert start == n_layers, (counts, n_layers)
    return result


def stage_module_names(plan: PipelinePlan, layer_keys: Sequence[str], layers_per_stage: list[list[int]]) -> list[list[str]]:
    """The module names of each stage: first modules, ``layers.<key>`` ..., last modules."""
    names = []
    for s, indices in enumerate(layers_per_stage):
        stage = list(plan.first) if s == 0 else []
        stage += [f"{plan.layers}.{layer_keys[i]}" for i in indices]
        if s == len(layers_per_stage) - 1:
            stage += list(plan.last)
        names.append(stage)
    return names


def check_stage_modules(plan: PipelinePlan, layer_keys: Sequence[str], stages: list[list[str]], num_stages: int) -> None:
    """Explicit stage module lists (as many as stages: config.validation) must cover the model
    once, in forward order."""
    expected = list(plan.first) + [f"{plan.layers}.{k}" for k in layer_keys] + list(plan.last)
    given = [name for stage in stages for name in stage]
    if given != expected:
        unknown = sorted(set(given) - set(expected))
        missing = [n for n in expected if n not in given]
        detail = (f"unknown {unknown}" if unknown else "") + (f" missing {missing}" if missing else "")
        raise ConfigError(
            f"parallelism.pp_stage_modules must list every module once, in forward order "
            f"({', '.join(expected)}): {detail.strip() or 'the order differs'}"
        )
    for s, stage in enumerate(stages):
        if not stage:
            raise ConfigError(f"parallelism.pp_stage_modules[{s}] is empty: every stage needs a module")
        misplaced = [n for n in stage if (n in plan.first and s != 0) or (n in plan.last and s != num_stages - 1)]
        if misplaced:
            raise ConfigError(
                f"parallelism.pp_stage_modules[{s}] has {misplaced}: {', '.join(plan.first)} belong to the first "
                f"stage and {', '.join(plan.last)} to the last"
            )


def stage_ids(pp_rank: int, pp: int, per_rank: int, placement: str) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in increasing order."""
    if placement == "loop":
        return [pp_rank + k * pp for k in range(per_rank)]
    if placement == "v":
        if per_rank != 2:  # (a run's V schedules are checked by config.validation.validate_pipeline_degrees)
            raise ValueError(f"V-shaped stage placement needs 2 stages per rank, got {per_rank}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    raise ValueError(f"placement={placement!r} is not 'loop' or 'v'")


def stage_rank(stage: int, pp: int, placement: str) -> int:
    if placement == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


# -- splitting a model -------------------------------------------------------------------


def _view(model: nn.Module, plan: PipelinePlan, keep: set[str]) -> nn.Module:
    """A module of ``model``'s class that shares its submodules but holds only ``keep``.

    Parameters and buffers placed directly on ``model`` are shared too (the same dicts), so
    materializing ``model`` materializes every view; hooks and child lists are the view's own.
    """
    view = copy.copy(model)  # a new object whose __dict__ is a shallow copy
    for name, value in list(view.__dict__.items()):
        if name in ("_parameters", "_buffers", "_non_persistent_buffers_set"):
            continue
        if isinstance(value, (dict, set)):
            view.__dict__[name] = copy.copy(value)
    layers = pipeline_layers(model, plan)
    view._modules[plan.layers] = nn.ModuleDict(
        {k: m for k, m in layers.items() if f"{plan.layers}.{k}" in keep}
    )
    for name in (*plan.first, *plan.last):
        if name not in keep:
            view._modules[name] = None
    return view


def split_model(model: nn.Module, plan: PipelinePlan, all_stages: list[list[str]], local: list[int]) -> list[nn.Module]:
    """Trim ``model`` (in place) to this rank's stages and return one view per local stage."""
    layers = pipeline_layers(model, plan)
    mine = {name for s in local for name in all_stages[s]}
    for key in list(layers.keys()):
        if f"{plan.layers}.{key}" not in mine:
            del layers[key]
    for name in (*plan.first, *plan.last):
        if name not in mine:
            setattr(model, name, None)
    return [_view(model, plan, set(all_stages[s])) for s in local]


@dataclass
class PipelineSplit:
    """One pipeline rank's share: its stage modules (``local`` stage ids, in order), every
    stage's module names, and the placement (``loop`` or ``v``)."""

    stages: list[nn.Module]
    names: list[list[str]]
    local: list[int]
    placement: str


def split_pipeline(module: nn.Module, plan: PipelinePlan, p: ParallelismConfig, pp_rank: int) -> PipelineSplit:
    """Cut ``module``'s model into ``p.num_stages`` stages (``p.pp_stage_modules``, else balanced
    by layers) and keep pipeline rank ``pp_rank``'s (see ``split_model``)."""
    model = pipeline_model(module, plan)
    keys = list(pipeline_layers(model, plan).keys())
    validate_stage_count(p, len(keys), f"len({type(model).__name__}.{plan.layers})")  # (a module without a job)
    if p.pp_stage_modules is not None:
        names = [list(stage) for stage in p.pp_stage_modules]
        check_stage_modules(plan, keys, names, p.num_stages)
    else:
        split = split_layers(len(keys), p.num_stages, first_weight=p.pp_first_stage_weight,
                             last_weight=p.pp_last_stage_weight)
        names = stage_module_names(plan, keys, split)
    placement = "v" if p.pp_schedule in V_PP_SCHEDULES else "loop"
    local = stage_ids(pp_rank, p.pp, p.stages_per_rank, placement)
    return PipelineSplit(split_model(model, plan, names, local), names, local, placement)


def stage_autocast(training: TrainingConfig | None, fsdp: bool, device_type: str):
    """bf16 autocast over fp32 parameters without FSDP, as CausalLMModule.forward does on one
    device: the schedule calls the stage modules directly, bypassing the module's forward."""
    if training is None or fsdp or (training.dtype, training.mixed_precision_param) != ("float32", "bfloat16"):
        return nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


def describe_split(stages: list[list[str]], config: Any, placement: str) -> str:
    """One line: schedule, stages, placement, microbatches and each stage's modules."""
    parts = []
    for s, names in enumerate(stages):
        items, run = [], []
        for name in names + [""]:
            if "." in name:
                run.append(name.rsplit(".", 1)[-1])
                continue
            if run:
                items.append(f"layers {run[0]}-{run[-1]}" if len(run) > 1 else f"layer {run[0]}")
                run = []
            if name:
                items.append(name)
        parts.append(f"{s}: {' + '.join(items)}")
    name = config.pp_schedule if config.pp_schedule_csv is None else config.pp_schedule_csv
    return (f"{name}, {len(stages)} stages ({config.stages_per_rank} per rank, {placement}), "
            f"{config.pp_microbatches} microbatches; stage " + "; ".join(parts))

