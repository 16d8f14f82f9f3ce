"""Which linears take adapters: ``lora.target_modules`` names them as the model's Hugging Face
family does (``q_proj`` ... or ``all-linear``), and the family's state-dict adapter maps our module
names to theirs (``hf_key``: ``layers.0.attention.wq.weight`` -> ``model.layers.0.self_attn.q_proj.weight``).

A linear is a target when it is a plain ``nn.Linear`` whose weight is one Hugging Face tensor or
a block of rows of one (not the output head: PEFT's ``all-linear`` leaves it out). The linears
whose weights are the parts of one fused tensor (Phi-3's q, k, v of ``qkv_proj``, gate and up of
``gate_up_proj``) are one target, as PEFT's: one A shared by the parts, and B's rows split as
the fused tensor's are, so ``B A`` is PEFT's update of the fused weight, row for row
(lora/layer.py ``add_adapters``). An MoE router's gate is one (``gate``). The routed experts are stacked weights, no
``nn.Linear``: they take adapters through ``lora.target_parameters`` as PEFT's ``target_parameters``
(lora/experts.py), so ``all-linear`` on an MoE model adapts attention and routers, as PEFT's does.

A family's adapter may list ``peft_parameter_names``: linears that are no ``nn.Linear`` in transformers
(gpt-oss's ``router``), which PEFT cannot wrap as modules: its ``all-linear`` leaves them out, and so
does ours; named, they take adapters, exported as PEFT's ``target_parameters`` (``router.weight``:
PEFT adds ``B A`` to the weight, the same A and B).

A family's adapter may list ``peft_expert_names``: names PEFT reads in ``target_modules`` as the routed
experts' tensors (PEFT 0.21 on transformers 5 converts DeepSeek V3's ``gate_proj`` / ``up_proj`` /
``down_proj`` to ``target_parameters``, as for checkpoints of the per-expert layout). Linears so named
(the dense layers' MLP, the shared experts) take no adapters: PEFT could not load them onto the base.
"""

import re
from typing import Any, Optional

from torch import nn

from titan_lightning.config.lora import ALL_LINEAR, LoRAConfig
from titan_lightning.lora.experts import add_expert_adapters
from titan_lightning.lora.layer import add_adapters

HEAD = "output"
_PART = re.compile(r"\[\w+\]$")  # a state-dict adapter's name of a block of rows of a fused tensor (``[q]``)


def hf_linears(model: nn.Module, adapter: Optional[Any]) -> dict[str, str]:
    """Our targetable linears -> their Hugging Face module names (``model.layers.0.self_attn.q_proj``);
    without a family adapter, our own names."""
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not name or name == HEAD:
            continue
        if type(module) is not nn.Linear and not hasattr(module, "lora_a"):
            continue  # a linear of another kind (the head, float8's)
        key = f"{name}.weight"
        hf = adapter.hf_key(key) if adapter is not None else key
        module = hf_module(hf)
        if module is None or (adapter is not None and adapter.export_group(key) != key and not _PART.search(hf)):
            continue  # (grouped with other keys, and not as a block of rows of one tensor)
        if short_name(module) in getattr(adapter, "peft_expert_names", ()):
            continue
        found[name] = module
    return found


def hf_module(hf_key: Optional[str]) -> Optional[str]:
    """The Hugging Face module a weight's key names (``...qkv_proj.weight[q]``, a block of rows of a
    fused tensor: ``...qkv_proj``); None for a key that is no module's weight."""
    if hf_key is None:
        return None
    key = _PART.sub("", hf_key)
    return key.removesuffix(".weight") if key.endswith(".weight") else None


def short_name(hf_module: str) -> str:
    return hf_module.rsplit(".", 1)[-1]


def lora_targets(model: nn.Module, adapter: Optional[Any], lora: LoRAConfig) -> dict[str, str]:
    """The linears ``lora.target_modules`` names (ours -> Hugging Face's module names); a one-line
    ValueError naming an unknown target and this family's valid names."""
    linears = hf_linears(model, adapter)
    valid = sorted({short_name(hf) for hf in linears.values()})
    wanted = lora.target_modules
    family = getattr(adapter, "family", None) or type(model).__name__
    experts = [name for name in wanted if name in getattr(adapter, "peft_expert_names", ())]
    if experts:
        raise ValueError(f"lora.target_modules={','.join(wanted)}: PEFT reads {experts[0]!r} on {family} as the routed "
                         f"experts' tensors, so adapters on the dense and shared MLPs would not load with PeftModel; "
                         f"valid: {', '.join(valid)} or {ALL_LINEAR}, and lora.target_parameters=gate_up_proj,down_proj "
                         f"for the experts")
    unknown = [name for name in wanted if name != ALL_LINEAR and name not in valid]
    if unknown or not linears:
        raise ValueError(f"lora.target_modules={','.join(wanted)}: {family} has no linear named {unknown[0]!r}; "
                         f"valid: {', '.join(valid)} or {ALL_LINEAR}" if unknown else
                         f"lora.target_modules={','.join(wanted)}: {family} has no linear that can take adapters")
    if wanted == [ALL_LINEAR]:
        return all_linear(linears, adapter)
    return {ours: hf for ours, hf in linears.items() if short_name(hf) in wanted}


def all_linear(linears: dict[str, str], adapter: Optional[Any]) -> dict[str, str]:
    """The ``linears`` (``hf_linears``') PEFT's ``all-linear`` adapts: not those transformers holds as
    another module (``peft_parameter_names``)."""
    parameters = getattr(adapter, "peft_parameter_names", ())
    return {ours: hf for ours, hf in linears.items() if short_name(hf) not in parameters}


def add_job_adapters(model: nn.Module, lora: LoRAConfig, adapter: Any) -> None:
    """``lora``'s adapters on ``model`` (its targets' linears and the routed experts' tensors), as a run adds them."""
    add_adapters(model, lora_targets(model, adapter, lora), rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout)
    add_expert_adapters(model, lora, getattr(adapter, "family", None))
