"""gpt-oss <-> Hugging Face ``GptOssForCausalLM``: state dicts and config.json.

Llama's names plus the biases (q/k/v/o projections, the router ``mlp.router.bias``) and the sinks
(``self_attn.sinks``); q and k rows and biases are permuted per head between the two RoPE layouts.
The experts are fused tensors over all experts: ``mlp.experts.gate_up_proj`` [E, dim, 2 * hidden]
with gate and up interleaved (gate the even columns, up the odd ones) and its bias [E, 2 * hidden],
``mlp.experts.down_proj`` [E, hidden, dim] and its bias [E, dim]; a load reads only the experts a
rank holds.

MXFP4 checkpoints (the published ones: ``quantization_config.quant_method: mxfp4``) hold the
experts' weights as ``*_blocks`` (uint8, two FP4 e2m1 values a byte, low nibble first, 32 values a
block) and ``*_scales`` (uint8 E8M0: 2^(s - 127) per block); they are dequantized as they are read
(``mxfp4_dequantized``), exactly as transformers' ``convert_moe_packed_tensors``. An export writes
the unquantized weights in the export dtype (bf16 or fp32) and no ``quantization_config``.

Hugging Face gpt-oss trains with an auxiliary load-balancing loss (``router_aux_loss_coef``), not
trained here; a model read from a config.json has no routing bias either (``load_balance_coeff``
None): pure top-k routing, as the checkpoint's.
"""

import json
import re
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from titan_lightning.checkpoint import Source
from titan_lightning.config import ConfigError
from titan_lightning.models.common.hf_checkpoint import HALF_ROTATED, LLAMA_BLOCK_KEYS, StateDictAdapter
from titan_lightning.models.common.hf_config import (DECODER_FIELDS, HFConfig, config_of, fields_of,
                                                     sliding_window_fields)
from titan_lightning.models.common.quantized import (  # noqa: F401 (dequantize_mxfp4: re-exported)
    MXFP4_QUANTIZATION, check_quantization, dequantize_mxfp4, mxfp4_dequantized)
from titan_lightning.models.common.safetensors_io import HFTensors
from titan_lightning.models.gpt_oss.model import GptOssArgs, GptOssYarn, alternating, gpt_oss_moe

_ATTENTION_KEYS = {ours: theirs for ours, theirs in LLAMA_BLOCK_KEYS.items() if not ours.startswith("feed_forward.")}
# MoEArgs fields -> config.json's (the experts' width is intermediate_size).
_MOE_FIELDS = {"hidden_dim": "intermediate_size", "num_experts": ("num_local_experts", "num_experts"),
               "top_k": "num_experts_per_tok", "swiglu_alpha": "swiglu_alpha", "swiglu_limit": "swiglu_limit"}
_YARN_FIELDS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate", "attention_factor")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_OURS_FUSED = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3|b1|b3)")


class GptOssStateDictAdapter(StateDictAdapter):
    """Our gpt-oss state dict <-> a Hugging Face GptOss one (MXFP4 experts dequantized on load)."""

    family = "gpt-oss"
    layer_keys = {
        **_ATTENTION_KEYS,  # Llama's attention, each projection with its bias
        **{ours.replace(".weight", ".bias"): theirs.replace(".weight", ".bias")
           for ours, theirs in _ATTENTION_KEYS.items() if ours.startswith("attention.w")},
        "attention.sinks.weight": "self_attn.sinks",
        "moe.router.gate.weight": "mlp.router.weight",
        "moe.router.gate.bias": "mlp.router.bias",
        "moe.experts.b2": "mlp.experts.down_proj_bias",
    }
    rope_halves = {**HALF_ROTATED, "attention.wq.bias": "n_heads", "attention.wk.bias": "n_kv_heads"}
    hf_model_types = ("gpt_oss",)
    # transformers' router is no nn.Linear: PEFT adapts its weight through target_parameters, and its
    # all-linear leaves it out (lora/targets.py).
    peft_parameter_names = ("router",)
    args_class, architecture = GptOssArgs, "GptOssForCausalLM"
    fixed_fields = {"attention_bias": True, "attention_dropout": 0.0}
    config_fields = {k: v for k, v in DECODER_FIELDS.items() if k != "ffn_hidden_dim"}  # the experts' width is moe's

    @classmethod
    def check_config(cls, job: Any) -> None:
        """Before launch: the attention kernels the sinks are exact on, no tensor-parallel experts
        (their biases), then every family's export rules."""
        attention = job.model.attention
        if attention not in ("sdpa", "flex", "allgather"):
            raise ConfigError(f"model.attention={attention!r}: gpt-oss's attention sinks are computed by sdpa, flex "
                              f"and (context parallel) allgather only")
        p = job.parallelism
        if p.tp > 1 and p.ep == 1:
            raise ConfigError(f"parallelism.tp={p.tp} with parallelism.ep=1 makes the experts tensor-parallel, which "
                              f"gpt-oss's expert biases are not here; set parallelism.ep to a multiple of tp")
        super().check_config(job)

    # -- state dicts --------------------------------------------------------------------------

    def hf_key(self, ours: str):
        match = _OURS_FUSED.fullmatch(ours)
        if match is None:
            return super().hf_key(ours)
        layer, name = match.groups()
        fused = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj", "b1": "gate_up_proj_bias",
                 "b3": "gate_up_proj_bias"}[name]
        return f"model.layers.{layer}.mlp.experts.{fused}"

    def export_group(self, ours: str) -> str:
        """Gate and up (weights, biases) of a layer's experts: one fused Hugging Face tensor each."""
        match = _OURS_FUSED.fullmatch(ours)
        if match is None or match[2] == "w2":
            return ours
        return f"layers.{match[1]}.moe.experts.{'w' if match[2].startswith('w') else 'b'}13"

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        fused: dict[str, dict[str, Tensor]] = {}  # layer -> our expert name -> tensor
        for key, value in state_dict.items():
            match = _OURS_FUSED.fullmatch(key)
            if match is not None:
                fused.setdefault(match[1], {})[match[2]] = value
        hf = super().to_hf({k: v for k, v in state_dict.items() if not _OURS_FUSED.fullmatch(k)})
        for layer, ours in fused.items():
            prefix = f"model.layers.{layer}.mlp.experts"
            if "w2" in ours:
                hf[f"{prefix}.down_proj"] = ours["w2"].transpose(1, 2).contiguous()
            for gate, up, name in (("w1", "w3", "gate_up_proj"), ("b1", "b3", "gate_up_proj_bias")):
                if (gate in ours) != (up in ours):
                    raise ValueError(f"layers.{layer}.moe.experts.{gate} and .{up} make one Hugging Face tensor "
                                     f"({prefix}.{name}): to_hf needs both (export_group)")
                if gate in ours:  # gate in the even columns, up in the odd: [E, dim, 2 * hidden] / [E, 2 * hidden]
                    pair = torch.stack([ours[gate], ours[up]], dim=-1)
                    hf[f"{prefix}.{name}"] = (pair.transpose(1, 2) if gate == "w1" else pair).flatten(-2)
        return hf

    def sources(self, tensors: HFTensors) -> dict[str, Source]:
        tensors = mxfp4_dequantized(tensors)
        fused = {k for k in tensors.keys() if _FUSED.fullmatch(k.removesuffix("_bias"))}
        rest = HFTensors({k: tensors.shape(k) for k in tensors.keys() if k not in fused}, tensors.read)
        sd = super().sources(rest)
        for key in sorted(fused):
            match = _FUSED.fullmatch(key.removesuffix("_bias"))
            layer, bias = match[1], key.endswith("_bias")
            if int(layer) >= self.args.n_layers:
                continue  # (the base refuses those layers' other tensors)
            ours = f"layers.{layer}.moe.experts."
            if match[2] == "down_proj" and bias:
                sd[ours + "b2"] = tensors.source(key)
            elif match[2] == "down_proj":
                sd[ours + "w2"] = _transposed(tensors, key)
            else:
                for name, column in (("b1" if bias else "w1", 0), ("b3" if bias else "w3", 1)):
                    sd[ours + name] = _deinterleaved(tensors, key, column, bias)
        return sd

    # -- config.json --------------------------------------------------------------------------

    @classmethod
    def read_fields(cls, config: HFConfig) -> dict[str, Any]:
        # transformers' GptOss never reads hidden_act (the experts' clamped SwiGLU is fixed), nor OpenAI's
        # initial_context_length (YaRN's original_max_position_embeddings holds it).
        config.ignore("hidden_act", "initial_context_length")
        # The weight of Hugging Face's auxiliary load-balancing loss: not trained here, and no routing bias
        # instead (the checkpoint has none), so routing is pure top-k.
        config.ignore("router_aux_loss_coef")
        quantization = config.get("quantization_config", default=None)
        if quantization is not None:
            # modules_to_not_convert: which stay unquantized; the checkpoint's keys say it too (*_blocks).
            check_quantization(quantization, config, MXFP4_QUANTIZATION, ignored=("modules_to_not_convert",))
        if "layer_types" not in config.values:  # transformers' default: sliding in the even layers
            config.values["layer_types"] = alternating(config.get("num_hidden_layers"))
        window, layer_types = sliding_window_fields(config, default_window=128)
        top_k = config.get("num_experts_per_tok")
        if config.get("experts_per_token", default=top_k) != top_k:  # OpenAI's name of the same field
            raise ConfigError(f"{config.source}: experts_per_token={config.values['experts_per_token']} differs from "
                              f"num_experts_per_tok={top_k}")
        fields = super().read_fields(config)
        fields["head_dim"] = fields["head_dim"] or fields["dim"] // fields["n_heads"]
        moe = fields_of(config, _MOE_FIELDS, swiglu_alpha=1.702, swiglu_limit=7.0)
        swiglu = {name: moe.pop(name) for name in ("swiglu_alpha", "swiglu_limit")}
        moe = replace(gpt_oss_moe(**moe, load_balance_coeff=None), **swiglu)
        return {**fields, "moe": moe, "sliding_window": window, "layer_types": layer_types}

    @classmethod
    def read_rope(cls, config: HFConfig) -> dict[str, Any]:
        theta, scaling = config.rope()
        return {"rope_theta": theta,
                "rope_scaling": yarn_from_hf(scaling, config.get("max_position_embeddings"), config.source)}

    @classmethod
    def check_expressible(cls, args: GptOssArgs) -> None:
        m = args.moe
        if (m.score_func != "softmax" or not m.route_norm or m.route_scale != 1.0 or m.score_before_experts
                or m.num_shared_experts or m.num_groups != 1 or not m.router_bias or not m.expert_biases
                or m.activation != "clamped_swiglu"):
            raise ConfigError(f"model.moe={m}: Hugging Face gpt-oss routes by a softmax over the top-k logits of a "
                              f"router with a bias, scale 1, to experts with biases and the clamped SwiGLU, no shared "
                              f"experts, no expert groups")

    @classmethod
    def write_rope(cls, args: GptOssArgs) -> dict[str, Any]:
        y = args.rope_scaling
        return {"rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta} if y is None else {
            "rope_type": "yarn", "rope_theta": args.rope_theta, "factor": y.factor, "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow, "original_max_position_embeddings": y.original_max_position_embeddings,
            "truncate": y.truncate, **({} if y.attention_factor is None else {"attention_factor": y.attention_factor})}}

    @classmethod
    def write_fields(cls, args: GptOssArgs) -> dict[str, Any]:
        m = args.moe
        types = args.layer_types or ["sliding_attention" if args.sliding_window else "full_attention"] * args.n_layers
        return {**config_of(m, _MOE_FIELDS), "sliding_window": args.sliding_window, "layer_types": list(types),
                "hidden_act": "silu"}


def yarn_from_hf(scaling: Any, max_positions: int, source: str):
    """``GptOssYarn`` (None for plain RoPE) from config.json's RoPE scaling, with transformers' defaults."""
    if scaling is None:
        return None
    if scaling.get("rope_type") != "yarn":
        raise ConfigError(f"{source}: rope_type={json.dumps(scaling.get('rope_type'))} is not supported for "
                          f"gpt-oss here (supported: \"default\", \"yarn\")")
    extra = sorted(set(scaling) - set(_YARN_FIELDS) - {"rope_type"})
    if extra:
        raise ConfigError(f"{source}: yarn RoPE field(s) {', '.join(f'{k}={json.dumps(scaling[k])}' for k in extra)} "
                          f"not modelled for gpt-oss here")
    if "original_max_position_embeddings" not in scaling:
        raise ConfigError(f"{source}: yarn RoPE needs original_max_position_embeddings")
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    return GptOssYarn(factor=float(factor), beta_fast=float(scaling.get("beta_fast") or 32),
                      beta_slow=float(scaling.get("beta_slow") or 1), original_max_position_embeddings=original,
                      truncate=bool(scaling.get("truncate", True)), attention_factor=scaling.get("attention_factor"))


def _transposed(tensors: HFTensors, key: str) -> Source:
    """``key`` [E, a, b] as [E, b, a], reading only the experts asked for."""
    e, a, b = tensors.shape(key)
    return Source((e, b, a), lambda index: tensors.read(key, index[:1]).transpose(1, 2)[(slice(None), *index[1:])])


def _deinterleaved(tensors: HFTensors, key: str, column: int, bias: bool) -> Source:
    """The gate (``column`` 0) or up (1) half of a fused ``gate_up_proj`` [E, dim, 2 * hidden] as
    [E, hidden, dim] (or of its bias [E, 2 * hidden] as [E, hidden])."""
    shape = tensors.shape(key)
    if shape[-1] % 2:
        raise ValueError(f"{key} has shape {list(shape)}: its last dim holds gate and up interleaved, so it must be even")
    if bias:
        return Source((shape[0], shape[1] // 2),
                      lambda index: tensors.read(key, index[:1])[:, column::2][(slice(None), *index[1:])])
    e, d, two_h = shape
    return Source((e, two_h // 2, d), lambda index: tensors.read(key, index[:1])[..., column::2].transpose(1, 2)
                  [(slice(None), *index[1:])])
