"""LoRA on the routed experts, as PEFT adapts transformers 5's fused expert tensors
(``LoraConfig.target_parameters``: ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``).

``lora.target_parameters`` names the tensors: ``gate_up_proj`` (the gate and up projections of
every expert, one adapter over both, as PEFT's) and ``down_proj``. Each gets per-expert factors
stacked like the experts' weights, A [E, r, in] and B [E, out, r] (PEFT's ``lora_A`` [E * r, in]
and ``lora_B`` [out, r * E] viewed per expert; A drawn as PEFT draws it, B zero), held by the
``GroupedExperts`` as its children ``lora_a`` / ``lora_b`` (ParameterDicts keyed by tensor name).

Every forward the experts compute with ``W + alpha / r * B A``, per expert, as PEFT does (it folds
the update into the weight for the call): the grouped GEMM and the per-expert loop run unchanged.
Under expert parallelism the factors are sharded on the expert dim with the weights
(parallel/expert.py shards every parameter of the experts), and under expert FSDP they are
sharded with them; the gradient factor of expert FSDP (``grad_scale``) applies to them too.

The rows of ``gate_up_proj``'s update split into the gate's (our ``w1``) and the up projection's
(``w3``) as the family's Hugging Face tensor holds them: gate rows then up rows, or interleaved
(gpt-oss: gate the even rows).
"""

import math
import re
from typing import Any, Callable, Optional

import torch
from torch import nn

from titan_lightning.config.lora import EXPERT_PARAMETERS, LoRAConfig
from titan_lightning.models.common.init import canonical_fqn

# Families (their state-dict adapter's ``family``) whose gate_up_proj interleaves gate and up (gate
# the even rows of the update).
INTERLEAVED_GATE_UP = ("gpt-oss",)


def routed_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if getattr(m, "routed_experts", False)]


def add_expert_adapters(model: nn.Module, lora: LoRAConfig, family: Optional[str] = None) -> None:
    """Adapters on the expert tensors ``lora.target_parameters`` names, in every MoE layer of
    ``model``; trainable, like the linears' (``add_adapters``, which runs first)."""
    if not lora.target_parameters:
        return
    for _, experts in routed_experts(model):
        num_experts, hidden, dim = experts.w1.shape
        shapes = {"gate_up_proj": (dim, 2 * hidden), "down_proj": (hidden, dim)}  # (in, out)
        device, dtype = experts.w1.device, experts.w1.dtype
        experts.lora_a, experts.lora_b = nn.ParameterDict(), nn.ParameterDict()
        for name in (name for name in EXPERT_PARAMETERS if name in lora.target_parameters):
            fan_in, out = shapes[name]
            experts.lora_a[name] = nn.Parameter(torch.empty(num_experts, lora.rank, fan_in, device=device, dtype=dtype))
            experts.lora_b[name] = nn.Parameter(torch.empty(num_experts, out, lora.rank, device=device, dtype=dtype))
        experts.lora_scaling = lora.alpha / lora.rank
        experts.lora_interleaved = family in INTERLEAVED_GATE_UP
        experts.adapters_on = True
        experts.adapt = adapted_weights
    if hasattr(model, "init_param"):
        model.init_param = _InitExpertAdapters(model.init_param)


def expert_adapters(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The routed experts that carry adapters (their names within ``model``)."""
    return [(name, m) for name, m in routed_experts(model) if getattr(m, "adapt", None) is not None]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def expert_updates(experts: nn.Module, dtype: torch.dtype,
                   local: Callable[[torch.Tensor], torch.Tensor] = _local) -> dict[str, torch.Tensor]:
    """``alpha / r * B A`` of each adapted tensor ([E, out, in], this rank's experts), in ``dtype``."""
    return {name: torch.bmm(local(experts.lora_b[name]).to(dtype), local(a).to(dtype)) * experts.lora_scaling
            for name, a in experts.lora_a.items()}


def split_gate_up(experts: nn.Module, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up_proj's update [E, 2 * hidden, dim] -> the gate's (w1) and the up projection's (w3)."""
    if experts.lora_interleaved:
        return update[:, 0::2], update[:, 1::2]
    return update.chunk(2, dim=1)


def adapted_weights(experts: nn.Module, weights: tuple[torch.Tensor, ...],
                    local: Callable[[torch.Tensor], torch.Tensor] = _local) -> tuple[torch.Tensor, ...]:
    """``GroupedExperts.weights``' (w1, w2, w3) with the adapters' updates added (``GroupedExperts.adapt``)."""
    if not experts.adapters_on:
        return weights
    w1, w2, w3 = weights
    updates = expert_updates(experts, w1.dtype, local)
    if "gate_up_proj" in updates:
        gate, up = split_gate_up(experts, updates["gate_up_proj"])
        w1, w3 = w1 + gate, w3 + up
    if "down_proj" in updates:
        w2 = w2 + updates["down_proj"]
    return w1, w2, w3


class _InitExpertAdapters:
    """The model's init law, and the expert adapters': A as PEFT draws its [E * r, in] ``lora_A``
    (``kaiming_uniform_(a=sqrt(5))``: fan-in ``in``), B zero."""

    def __init__(self, law: Any) -> None:
        self.law = law

    def __call__(self, fqn: str, w: torch.Tensor, g: torch.Generator) -> None:
        owner, _, _ = fqn.rpartition(".")
        if owner.endswith(".lora_a") and w.dim() == 3:
            nn.init.kaiming_uniform_(w.view(-1, w.shape[-1]), a=math.sqrt(5), generator=g)
        elif owner.endswith(".lora_b") and w.dim() == 3:
            nn.init.zeros_(w)
        else:
            self.law(fqn, w, g)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


@torch.no_grad()
def merged_expert_weights(experts: nn.Module) -> dict[str, torch.Tensor]:
    """``w1``, ``w2``, ``w3`` (full tensors: a DTensor's are gathered) plus their adapters' updates,
    in the weights' dtype, computed in fp32: what a merged export writes."""
    weights = {name: _full(getattr(experts, name)) for name in ("w1", "w2", "w3")}
    merged = adapted_weights(experts, tuple(w.float() for w in weights.values()), local=_full)
    return {name: m.to(w.dtype) for (name, w), m in zip(weights.items(), merged)}


def hf_experts_module(adapter: Any, name: str) -> str:
    """The Hugging Face module of the experts ``name`` (``model.layers.0.mlp.experts``)."""
    hf = adapter.hf_key(f"{name}.w2")  # ('...experts.*.down_proj.weight', or fused: '...experts.down_proj')
    return hf.split(".*.")[0] if ".*." in hf else hf.rpartition(".")[0]


def expert_peft_state(model: nn.Module, adapter: Any) -> dict[str, torch.Tensor]:
    """The experts' factors as PEFT's ParamWrapper saves them, keys within the model: per Hugging Face
    experts module ``<experts>.lora_A.weight`` [E * r, in] and ``lora_B.weight`` [out, r * E], PEFT's
    wrappers nested in the order of the experts' tensors (gate_up_proj innermost: ``base_layer.``)."""
    state = {}
    for name, experts in expert_adapters(model):
        module = hf_experts_module(adapter, canonical_fqn(name))
        for tensor in experts.lora_a:
            prefix = peft_factor_prefix(module, list(experts.lora_a), tensor)
            a, b = _full(experts.lora_a[tensor]), _full(experts.lora_b[tensor])
            state[f"{prefix}lora_A.weight"] = a.reshape(-1, a.shape[-1])
            state[f"{prefix}lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1)
    return state


def peft_factor_prefix(module: str, tensors: list[str], tensor: str) -> str:
    """The key prefix of ``tensor``'s factors among the adapted ``tensors`` of the Hugging Face experts
    ``module``: PEFT nests a wrapper per tensor, the first innermost (``<module>.base_layer.``)."""
    return f"{module}." + "base_layer." * (len(tensors) - 1 - tensors.index(tensor))


def _unwrapped(module: str) -> str:
    while module.endswith(".base_layer"):
        module = module.removesuffix(".base_layer")
    return module


def is_expert_factor(key: str) -> bool:
    """Whether a PEFT key (``expert_peft_state``'s) is an expert factor."""
    return _unwrapped(key.rsplit(".", 2)[0]).endswith(".experts")


def peft_target_parameters(state: dict[str, torch.Tensor], lora: LoRAConfig) -> list[str]:
    """adapter_config.json's ``target_parameters`` for ``state``'s expert factors (``mlp.experts.gate_up_proj``)."""
    modules = {re.sub(r"^.*\blayers\.\d+\.", "", _unwrapped(key.rsplit(".", 2)[0]))
               for key in state if is_expert_factor(key)}
    return [f"{module}.{tensor}" for module in sorted(modules) for tensor in EXPERT_PARAMETERS
            if tensor in lora.target_parameters]
