"""A LoRA run's weights out: its adapters as the folder PEFT writes (``adapter_config.json``,
``adapter_model.safetensors``), which ``PeftModel.from_pretrained(base, folder)`` loads onto the
base Hugging Face model, and the merged model (``W + alpha / rank * B A`` in every target) that
an ``hf`` export writes as a full folder (callbacks/weights.py).

PEFT's keys are ``base_model.model.<Hugging Face module>.lora_A.weight`` / ``lora_B.weight`` (its
adapter name, "default", left out). A Hugging Face tensor whose rows the family's adapter permutes
(q_proj and k_proj: RoPE's layout) has lora_B's rows permuted alike; lora_A's columns are the
layer's input features, never permuted.
"""

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from safetensors.torch import save_file
from torch import nn

from titan_lightning.lora.experts import (expert_adapters, expert_peft_state, is_expert_factor, merged_expert_weights,
                                          peft_target_parameters)
from titan_lightning.lora.layer import base_only, lora_layers, merged_weight
from titan_lightning.lora.targets import hf_module, short_name
from titan_lightning.models.common.init import canonical_fqn

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _untied(adapter: Any) -> Any:
    """The family's adapter converting single tensors (no tied head to drop)."""
    return type(adapter)(adapter.args)


def peft_state(model: nn.Module, adapter: Any, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The adapters as PEFT names and lays them out, full tensors on the CPU (a DTensor gathered:
    run on every rank, in the same order)."""
    adapter = _untied(adapter)
    state = {}
    for module, layers in adapter_groups(model, adapter).items():
        a = _full(layers[0][1].lora_a.weight)
        b = adapter.to_hf({key: _full(layer.lora_b.weight) for key, layer in layers})[f"{module}.weight"]
        state[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.to("cpu", dtype).contiguous()
        state[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.to("cpu", dtype).contiguous()
    for key, factor in expert_peft_state(model, adapter).items():  # (the routed experts': lora/experts.py)
        state[f"{PEFT_PREFIX}{key}"] = factor.to("cpu", dtype).contiguous()
    return state


def adapter_groups(model: nn.Module, adapter: Any) -> dict[str, list[tuple[str, Any]]]:
    """The Hugging Face module of each adapter PEFT holds -> our (weight key, LoRALinear) that make
    it: one, or the parts of a fused tensor (Phi-3's q, k, v of ``qkv_proj``), in our order; the
    parts share their A (lora/layer.py ``add_adapters``) and their Bs are blocks of its rows."""
    groups: dict[str, list[tuple[str, Any]]] = {}
    for name, layer in lora_layers(model):
        key = f"{canonical_fqn(name)}.weight"
        groups.setdefault(hf_module(adapter.hf_key(key)), []).append((key, layer))
    for module, layers in groups.items():
        if any(layer.lora_a is not layers[0][1].lora_a for _, layer in layers):
            raise ValueError(f"{module}: its parts ({', '.join(key for key, _ in layers)}) hold adapters of their "
                             f"own, not one shared A as PEFT's fused linear has")
    return groups


def peft_config(state: dict[str, torch.Tensor], lora: Any, base: Optional[str], wrapped: Optional[str] = None,
                parameter_names: tuple[str, ...] = ()) -> dict[str, Any]:
    """adapter_config.json for ``state`` (``peft_state``): PEFT's LoraConfig fields. ``wrapped``: the
    prefix of the text model in a base that wraps it (``wrap_state``): the targets are named within
    it (a regex), so PEFT adapts no linear of the wrapper's other parts (a vision tower's q_proj).
    ``parameter_names``: targets transformers holds as no nn.Linear (the family adapter's
    ``peft_parameter_names``), named in ``target_parameters`` by their weight."""
    names = sorted({short_name(key.removesuffix(".lora_A.weight")) for key in state
                    if key.endswith(".lora_A.weight") and not is_expert_factor(key)})
    modules = [name for name in names if name not in parameter_names]
    targets: Any = modules if wrapped is None or not modules else rf"{re.escape(wrapped)}.*\.({'|'.join(modules)})"
    parameters = [f"{name}.weight" for name in names if name in parameter_names]  # (PEFT adds B A to the weight)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": targets, "bias": "none",
            "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "inference_mode": True, "modules_to_save": None,
            "target_parameters": (peft_target_parameters(state, lora) or []) + parameters or None}


def wrap_state(state: dict[str, torch.Tensor], wrapper: tuple[str, str]) -> dict[str, torch.Tensor]:
    """``state`` (``peft_state``'s names: the text model's) named as in the base that wraps the text
    model (``StateDictAdapter.wrapper_of``: Gemma 3's multimodal model, ``model.language_model.``)."""
    text, wrapped = (PEFT_PREFIX + prefix for prefix in wrapper)
    return {wrapped + key[len(text):] if key.startswith(text) else key: value for key, value in state.items()}


def write_peft_folder(folder: Path, state: dict[str, torch.Tensor], lora: Any, base: Optional[str],
                      adapter: Any = None) -> None:
    """PEFT's adapter folder of ``state`` on ``base``, as the family ``adapter`` (its state-dict adapter)
    names it in transformers: the targets it holds as no nn.Linear, a base wrapping the text model."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = adapter.wrapper_of(base) if hasattr(adapter, "wrapper_of") else None
    if wrapper is not None:
        state = wrap_state(state, wrapper)
    save_file(state, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_config(state, lora, base, wrapper[1] if wrapper is not None else None,
                         getattr(adapter, "peft_parameter_names", ()))
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


class MergedState(Mapping):
    """``model``'s base state dict (our names) with every target's weight merged with its adapter,
    each computed when read (one full tensor at a time: an export walks it key by key)."""

    def __init__(self, model: nn.Module) -> None:
        with base_only(model):
            self.base = model.state_dict()
        self.layers = {f"{canonical_fqn(name)}.weight": layer for name, layer in lora_layers(model)}
        self.experts = {f"{canonical_fqn(name)}.{w}": experts for name, experts in expert_adapters(model)
                        for w in ("w1", "w2", "w3")}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.experts:
            return merged_expert_weights(self.experts[key])[key.rpartition(".")[2]]
        return merged_weight(self.layers[key]) if key in self.layers else self.base[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)
