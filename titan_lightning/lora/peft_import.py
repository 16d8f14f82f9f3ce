"""A PEFT adapter folder written by any tool (PEFT, TRL, axolotl, Unsloth ...: ``adapter_config.json``
and ``adapter_model.safetensors``) onto our model: the reverse of ``export``.

``adapter_config.json`` becomes ``job.lora`` (``lora_config``): ``r`` the rank, ``lora_alpha`` the
alpha (``use_rslora``'s ``alpha / sqrt(r)`` scaling as the alpha ``lora_alpha * sqrt(r)``), the
modules PEFT adapts (``target_modules``: a list of names, a regex over module names, or
``all-linear``; less ``exclude_modules``) as the names ``lora.target_modules`` gives (a name adapted
in some layers and not in others cannot be), ``target_parameters`` as ``lora.target_parameters``.
The tensors (``peft_tensors``) are mapped as ``export`` writes them, inverted: a target's Hugging Face
module name from the family's ``hf_key``, lora_B's rows through its ``from_hf`` (RoPE's row layout),
the routed experts' factors back to per-expert stacks; PEFT's keys with or without its adapter name
(``lora_A.weight``, ``lora_A.default.weight``). Anything else PEFT could compute is refused in one
line naming the field (``REFUSED``), as is a key the model has no place for and a target the file
holds no factor of.

``generate`` / ``chat --model ADAPTER_FOLDER`` try such a folder; ``lora.init_from`` starts a run's
adapters from one (``check_init_from`` before launch, ``load_peft_folder`` at the start of fit).
"""

import copy
import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file
from torch import nn

from titan_lightning.checkpoint.sources import Source, load_sources
from titan_lightning.config import ConfigError
from titan_lightning.config.lora import ALL_LINEAR, EXPERT_PARAMETERS, LoRAConfig
from titan_lightning.lora.experts import expert_adapters, hf_experts_module, peft_factor_prefix, routed_experts
from titan_lightning.lora.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, adapter_groups
from titan_lightning.lora.layer import lora_layers
from titan_lightning.lora.targets import add_job_adapters, all_linear, hf_linears, lora_targets, short_name
from titan_lightning.models.common.hf_config import read_json_object
from titan_lightning.models.common.init import canonical_fqn

ADAPTER_BIN = "adapter_model.bin"  # PEFT's file before safetensors: a pickled state dict
# Fields that change what PEFT computes -> (the values that leave plain LoRA, what is valid in words).
REFUSED: dict[str, tuple[tuple, str]] = {
    "use_dora": ((False, None), "false (DoRA's magnitude vectors are not built here)"),
    "bias": (("none", None), '"none" (trained biases are not loaded here)'),
    "lora_bias": ((False, None), "false (a bias on lora_B is not built here)"),
    "modules_to_save": ((None, []), "null (whole trained modules beside the adapters are not loaded here)"),
    "layers_to_transform": ((None, []), "null (adapters in every layer)"),
    "layers_pattern": ((None, [], ""), "null (adapters in every layer)"),
    "rank_pattern": (({}, None), "{} (one rank for every target)"),
    "alpha_pattern": (({}, None), "{} (one alpha for every target)"),
    "fan_in_fan_out": ((False, None), "false (nn.Linear's [out, in] weights)"),
    "trainable_token_indices": ((None, {}, []), "null (trained embedding rows are not loaded here)"),
    "layer_replication": ((None, []), "null (the base model's layers as they are)"),
    "alora_invocation_tokens": ((None, []), "null (plain LoRA, active on every token)"),
    "use_qalora": ((False, None), "false (QA-LoRA's pooled inputs are not built here)"),
    "use_bdlora": ((None,), "null (full-rank A and B)"),
    "arrow_config": ((None,), "null (one adapter, no routing between adapters)"),
    "kasa_config": ((None,), "null (plain LoRA)"),
    "velora_config": ((None,), "null (plain LoRA)"),
    "monteclora_config": ((None,), "null (plain LoRA)"),
}
# Fields read here, and fields that leave a saved adapter's computation as it is (its init, its version,
# how it trained).
READ = ("peft_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules", "exclude_modules",
        "target_parameters", "base_model_name_or_path")
IGNORED = ("task_type", "auto_mapping", "peft_version", "revision", "inference_mode", "init_lora_weights",
           "megatron_config", "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
           "qalora_group_size", "runtime_config", "ensure_weight_tying")
log = logging.getLogger(__name__)
_ADAPTER_NAME = re.compile(r"\.(lora_[AB])\.default\.weight$")  # PEFT's key with its adapter name kept


def is_peft_folder(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file()


def read_adapter_config(folder: Path) -> dict[str, Any]:
    """``folder``'s adapter_config.json, refused in one line (the file, the field, its value and what
    is valid) when it asks for more than LoRA as ``job.lora`` computes it."""
    where = folder / ADAPTER_CONFIG
    config = read_json_object(where)
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{where}: peft_type={json.dumps(config.get('peft_type'))} is not an adapter built here; "
                          f"valid: \"LORA\"")
    for name, value in config.items():
        if name in REFUSED and value not in REFUSED[name][0]:
            raise ConfigError(f"{where}: {name}={json.dumps(value)} is not reproduced here; valid: {REFUSED[name][1]}")
        if name not in REFUSED and name not in READ and name not in IGNORED and value:
            raise ConfigError(f"{where}: {name}={json.dumps(value)} is a field this reader does not know (it reads "
                              f"PEFT 0.21's LoRA); valid: the field left out, or null")
    return config


def peft_base(config: dict[str, Any]) -> Optional[str]:
    """The base model the adapter was made on, as adapter_config.json names it (a folder or a Hub id)."""
    return config.get("base_model_name_or_path")


def _named(patterns: Any, name: str) -> bool:
    """PEFT's match of a module (or parameter) name: a regex matching all of it, or a list of names each
    matching all of it or its end (``check_target_module_exists``)."""
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(name == p or name.endswith(f".{p}") for p in patterns or ())


def _peft_targets(config: dict[str, Any], modules: list[str], weights: list[str], adapter: Any,
                  every_linear: set[str]) -> list[str]:
    """The ``modules`` (Hugging Face module names) PEFT adapts: not in ``exclude_modules``, and named by
    ``target_modules`` (``all-linear``: those of ``every_linear``) or their weight by
    ``weights`` (``target_parameters`` such as ``gate.weight``: PEFT adds ``B A`` to the weight, which
    computes what LoRA on the linear does).
    A module is matched by its name or the one a model wrapping the text model gives it (``adapter``'s
    ``wrapper_prefixes``: an adapter made on Gemma 3's multimodal model names ``model.language_model.``)."""
    wanted, excluded = config.get("target_modules"), config.get("exclude_modules")
    every = isinstance(wanted, str) and wanted.lower() == ALL_LINEAR

    def named(patterns: Any, module: str, suffix: str = "") -> bool:
        return any(_named(patterns, name + suffix) for name in _wrapped_names(module, adapter))

    return [m for m in modules if not named(excluded, m)
            and ((every and m in every_linear) or named(wanted, m) or named(weights, m, ".weight"))]


def _wrapped_names(module: str, adapter: Any) -> list[str]:
    """``module`` (the text model's name) and its names in the models that wrap the text model."""
    prefixes = getattr(adapter, "wrapper_prefixes", {})
    return [module, *(wrapped + module[len(text):] for wrapped, text in prefixes.items() if module.startswith(text))]


def lora_config(config: dict[str, Any], model: nn.Module, adapter: Any, where: Path) -> LoRAConfig:
    """adapter_config.json (``read_adapter_config``'s) as ``job.lora`` for ``model`` (ours, without
    adapters; the meta device will do) of the family ``adapter``: one line naming the field otherwise."""
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    where = where / ADAPTER_CONFIG
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"{where}: r={json.dumps(rank)}; valid: an integer >= 1")
    if isinstance(alpha, (int, float)) and config.get("use_rslora"):
        alpha = alpha * math.sqrt(rank)  # rsLoRA scales by alpha / sqrt(r): alpha * sqrt(r) / r
    parameters = [str(p) for p in config.get("target_parameters") or []]
    tensors = [p.rpartition(".")[2] for p in parameters if p.rpartition(".")[2] in EXPERT_PARAMETERS]
    weights = [p for p in parameters if p.rpartition(".")[2] not in EXPERT_PARAMETERS]
    _check_every_moe_layer(parameters, model, adapter, where)
    found = hf_linears(model, adapter)
    linears, every_linear = list(found.values()), set(all_linear(found, adapter).values())
    strays = [p for p in weights
              if not any(_named([p], f"{n}.weight") for m in linears for n in _wrapped_names(m, adapter))]
    if strays or len(set(tensors)) != len(tensors):
        raise ConfigError(f"{where}: target_parameters={json.dumps(parameters)}: valid: the routed experts' "
                          f"{' and '.join(EXPERT_PARAMETERS)} (mlp.experts.gate_up_proj ...) each once, and the "
                          f"weights of linears (gate.weight)")
    adapted = _peft_targets(config, linears, weights, adapter, every_linear)
    names = [ALL_LINEAR] if set(adapted) == every_linear else sorted({short_name(m) for m in adapted})
    try:
        lora = LoRAConfig(rank=rank, alpha=alpha, dropout=config.get("lora_dropout", 0.0),
                          target_modules=names or [ALL_LINEAR], target_parameters=tensors)
        ours = set(lora_targets(model, adapter, lora).values())
    except ValueError as err:
        message = str(err).replace("lora.rank", "r").replace("lora.alpha", "lora_alpha").replace("lora.", "")
        raise ConfigError(f"{where}: {message}") from None
    if not adapted or ours != set(adapted):
        family = getattr(adapter, "family", type(model).__name__)
        left = sorted(ours - set(adapted))
        alone = " (adapters on the routed experts alone are not built here)" if tensors else ""
        why = f"adapts none of {family}'s linears{alone}" if not adapted else \
            f"adapts {sorted(adapted)[0]} but not {left[0]}, which job.lora cannot express"
        raise ConfigError(f"{where}: target_modules={json.dumps(config.get('target_modules'))}: {why}; valid: "
                          f"names adapted in every layer ({', '.join(sorted({short_name(m) for m in linears}))}) "
                          f"or \"{ALL_LINEAR}\"")
    return lora


def _check_every_moe_layer(parameters: list[str], model: nn.Module, adapter: Any, where: Path) -> None:
    """Each expert tensor ``target_parameters`` names (``gate_up_proj``, ``7.mlp.experts.gate_up_proj``)
    is every MoE layer's: one line for a name that reaches some layers only (as OpenAI's gpt-oss
    fine-tuning recipe writes them), which ``job.lora.target_parameters`` cannot express."""
    modules = [hf_experts_module(adapter, canonical_fqn(name)) for name, _ in routed_experts(model)]
    for p in parameters:
        tensor = p.rpartition(".")[2]
        if tensor not in EXPERT_PARAMETERS or not modules:
            continue
        reached = [m for m in modules if any(_named([p], f"{n}.{tensor}") for n in _wrapped_names(m, adapter))]
        if len(reached) != len(modules):
            raise ConfigError(f"{where}: target_parameters entry {p!r} reaches the routed experts of {len(reached)} "
                              f"of the {len(modules)} MoE layers; adapters here go on every MoE layer's experts: "
                              f"valid: {tensor!r} (mlp.experts.{tensor})")


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / ADAPTER_WEIGHTS).is_file():
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    elif (folder / ADAPTER_BIN).is_file():  # (plain tensors only: nothing a pickle could run)
        tensors = torch.load(folder / ADAPTER_BIN, map_location="cpu", weights_only=True)
    else:
        raise ConfigError(f"{folder}: holds {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS} (or {ADAPTER_BIN}); give the "
                          f"folder the adapter was saved to")
    return {_ADAPTER_NAME.sub(r".\1.weight", key): t for key, t in tensors.items()}


def peft_tensors(folder: Path, model: nn.Module, adapter: Any, *, partial: bool = False) -> dict[str, torch.Tensor]:
    """The adapters of ``folder``'s weights file as ``model``'s parameters (names within ``model``, which
    has its adapters: ``lora_config``'s; the meta device will do), in the file's dtype; one line for a
    key with no place in the model (``partial``: a pipeline stage's, which holds some layers, skips
    them), a factor missing from the file or a shape that differs."""
    file, others = {}, 0
    for key, tensor in _read_weights(folder).items():  # (an adapter made on a model wrapping ours: its names)
        name = key.removeprefix(PEFT_PREFIX)
        if key.startswith(PEFT_PREFIX) and hasattr(adapter, "unwrapped"):
            name = adapter.unwrapped(name)
        if name is None:
            others += 1
        else:
            file[key if name == key else PEFT_PREFIX + name] = tensor
    if others:
        log.info("%s: %d adapter tensors on the wrapping model's other parts (a vision tower) left out, as its "
                 "weights are", folder, others)
    # PEFT key -> {our parameter: PEFT's tensor -> ours} (a fused linear's B: a block of its rows each part's)
    convert: dict[str, dict[str, Any]] = {}
    names = {f"{canonical_fqn(name)}.weight": name for name, _ in lora_layers(model)}
    for hf, layers in adapter_groups(model, adapter).items():
        keys = [key for key, _ in layers]
        convert[f"{PEFT_PREFIX}{hf}.lora_A.weight"] = {f"{names[keys[0]]}.lora_a.weight": lambda a: a}  # (shared)
        convert[f"{PEFT_PREFIX}{hf}.lora_B.weight"] = {
            f"{names[key]}.lora_b.weight": lambda b, hf=hf, key=key: adapter.from_hf({f"{hf}.weight": b})[key]
            for key in keys}
    for name, experts in expert_adapters(model):
        module, tensors = hf_experts_module(adapter, canonical_fqn(name)), list(experts.lora_a)
        for tensor in tensors:
            prefix = f"{PEFT_PREFIX}{peft_factor_prefix(module, tensors, tensor)}"
            count, rank, _ = experts.lora_a[tensor].shape  # (expert_peft_state's layouts, undone)
            convert[f"{prefix}lora_A.weight"] = {f"{name}.lora_a.{tensor}":  # [E * r, in] -> [E, r, in]
                                                 lambda a, e=count: a.reshape(e, -1, a.shape[-1])}
            convert[f"{prefix}lora_B.weight"] = {f"{name}.lora_b.{tensor}":  # [out, r * E] -> [E, out, r]
                                                 lambda b, e=count, r=rank: b.reshape(-1, r, e).permute(2, 0, 1)}
    source = folder / (ADAPTER_WEIGHTS if (folder / ADAPTER_WEIGHTS).is_file() else ADAPTER_BIN)
    unmatched, missing = sorted(file.keys() - convert.keys()), sorted(convert.keys() - file.keys())
    if unmatched and not partial:
        raise ConfigError(f"{source}: {unmatched[0]} ({len(unmatched)} such keys) has no place in the model "
                          f"adapter_config.json describes; valid: lora_A / lora_B of its targets "
                          f"({next(iter(convert), 'none')} ...)")
    if missing:
        raise ConfigError(f"{source}: no {missing[0]} ({len(missing)} missing), an adapter adapter_config.json "
                          f"targets; valid: a file holding every target's lora_A and lora_B")
    state = {}
    for key, parts in convert.items():
        for ours, to_ours in parts.items():
            want = model.get_parameter(ours).shape
            try:
                value = to_ours(file[key])
            except (RuntimeError, ValueError):  # (a layout that cannot be undone: a shape that differs)
                value = None
            if value is None or value.shape != want:
                block = " (a block of its rows)" if len(parts) > 1 else ""
                raise ConfigError(f"{source}: {key} has shape {list(file[key].shape)}, not the adapter of {ours} "
                                  f"{list(want)}{block}; valid: r={rank_of(model, ours)} on this base")
            state[ours] = value.contiguous()
    return state


def rank_of(model: nn.Module, parameter: str) -> int:
    """The rank of the adapter factor ``parameter`` (lora_a [r, in], or the experts' [E, r, in] / [E, out, r])."""
    shape = model.get_parameter(parameter).shape
    return shape[-2] if ".lora_a" in parameter else shape[-1]


@torch.no_grad()
def load_peft_tensors(model: nn.Module, state: dict[str, torch.Tensor], source: str = "adapters") -> None:
    """``peft_tensors``' values into ``model``'s adapters, cast to their dtype and device; a sharded
    one (FSDP2, TP, EP: a DTensor) takes its own block."""
    owners: dict[str, dict[str, Source]] = {}
    for name, value in state.items():
        owner, _, key = name.rpartition(".")
        owners.setdefault(owner, {})[key] = Source.of(value)
    for owner, sources in owners.items():  # (lora_a / lora_b: a Linear, or the experts' ParameterDict)
        load_sources(model.get_submodule(owner), sources, source=source)


def check_init_from(lora: LoRAConfig, model: nn.Module, adapter: Any) -> None:
    """Before the launch of a fresh run (a resumed one never reads the folder): ``lora.init_from`` is
    a PEFT folder whose adapters are the job's (rank, alpha, targets: one line with the options that
    make them so) and whose every tensor has its place in ``model`` (ours, without adapters, on the
    meta device)."""
    folder = Path(lora.init_from)
    if not is_peft_folder(folder):
        raise ConfigError(f"lora.init_from={lora.init_from!r} holds no {ADAPTER_CONFIG}; valid: a PEFT adapter folder "
                          f"({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    theirs = lora_config(read_adapter_config(folder), model, adapter, folder)
    targets = [set(lora_targets(model, adapter, c).values()) for c in (lora, theirs)]
    if (lora.rank != theirs.rank or not math.isclose(lora.alpha, theirs.alpha) or targets[0] != targets[1]
            or set(lora.target_parameters) != set(theirs.target_parameters)):
        experts = theirs.target_parameters and f" --job.lora.target_parameters {','.join(theirs.target_parameters)}"
        raise ConfigError(f"lora.init_from={lora.init_from!r} holds adapters of rank {theirs.rank}, alpha "
                          f"{theirs.alpha} on {','.join(theirs.target_modules)}, not the job's lora.rank={lora.rank}, "
                          f"lora.alpha={lora.alpha}, lora.target_modules={','.join(lora.target_modules)}; valid: "
                          f"--job.lora.rank {theirs.rank} --job.lora.alpha {theirs.alpha} --job.lora.target_modules "
                          f"{','.join(theirs.target_modules)}{experts or ''}")
    with_adapters = copy.deepcopy(model)
    add_job_adapters(with_adapters, lora, adapter)
    peft_tensors(folder, with_adapters, adapter)


def load_peft_folder(model: nn.Module, adapter: Any, folder: Path, *, partial: bool = False) -> None:
    """The adapters of the PEFT ``folder`` into ``model``'s (a run's: sharded, wrapped, a pipeline
    stage's with ``partial``), as ``check_init_from`` checked them."""
    load_peft_tensors(model, peft_tensors(folder, model, adapter, partial=partial), str(folder))
