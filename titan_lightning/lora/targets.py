"""Which linears take adapters: ``lora.target_modules`` names them as the model's Hugging Face
family does (``q_proj`` ... or ``all-linear``), and the family's state-dict adapter maps our module
names to theirs (``hf_key``: ``layers.0.attention.wq.weight`` -> ``model.layers.0.self_attn.q_proj.weight``).

A linear is a target when it is a plain ``nn.Linear`` whose weight is one whole Hugging Face tensor:
not the output head (PEFT's ``all-linear`` leaves it out), not a part of a fused tensor (Phi-3's
``qkv_proj``, ``gate_up_proj``: PEFT's single A and B over the fused rows are no sum of per-part
adapters). An MoE router's gate is one (``gate``). The routed experts are stacked weights, no
``nn.Linear``: they take adapters through ``lora.target_parameters`` as PEFT's ``target_parameters``
(lora/experts.py), so ``all-linear`` on an MoE model adapts attention and routers, as PEFT's does.
"""

from typing import Any, Optional

from torch import nn

from titan_lightning.config.lora import ALL_LINEAR, LoRAConfig

HEAD = "output"


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
        if hf is None or not hf.endswith(".weight") or (adapter is not None and adapter.export_group(key) != key):
            continue
        found[name] = hf.removesuffix(".weight")
    return found


def short_name(hf_module: str) -> str:
    return hf_module.rsplit(".", 1)[-1]


def lora_targets(model: nn.Module, adapter: Optional[Any], lora: LoRAConfig) -> dict[str, str]:
    """The linears ``lora.target_modules`` names (ours -> Hugging Face's module names); a one-line
    ValueError naming an unknown target and this family's valid names."""
    linears = hf_linears(model, adapter)
    valid = sorted({short_name(hf) for hf in linears.values()})
    wanted = lora.target_modules
    unknown = [name for name in wanted if name != ALL_LINEAR and name not in valid]
    if unknown or not linears:
        family = getattr(adapter, "family", None) or type(model).__name__
        raise ValueError(f"lora.target_modules={','.join(wanted)}: {family} has no linear named {unknown[0]!r}; "
                         f"valid: {', '.join(valid)} or {ALL_LINEAR}" if unknown else
                         f"lora.target_modules={','.join(wanted)}: {family} has no linear that can take adapters")
    if wanted == [ALL_LINEAR]:
        return linears
    return {ours: hf for ours, hf in linears.items() if short_name(hf) in wanted}
