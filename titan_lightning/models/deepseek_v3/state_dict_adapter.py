"""DeepSeek V3 <-> Hugging Face ``DeepseekV3ForCausalLM``: state dicts and config.json.

Names map one to one, the routed experts stacked (models/common/hf_checkpoint.py has the layouts).
transformers 5 holds them fused in memory (``mlp.experts.gate_up_proj`` [E, 2 * hidden, dim], gate
rows first, and ``mlp.experts.down_proj``); ``from_hf`` reads that layout too, ``to_hf`` writes the
per-expert one of the published checkpoints.

RoPE needs no permutation: DeepSeek's checkpoints rotate adjacent feature pairs, as
models/common/rope.py does (transformers' ``rope_interleave=True``, its default, de-interleaves
q and k the same way before rotating halves, which leaves every q.k product unchanged).

Layers at or past ``n_layers`` (the 671B checkpoint's multi-token-prediction layer 61) are
skipped. Block-scaled FP8 checkpoints (the published 671B: float8_e4m3fn ``*.weight`` with a
float32 ``*.weight_scale_inv`` per 128 x 128 block) are dequantized as they are read (``dequantized``).

config.json: YaRN is on in our model when ``max_seq_len > original_seq_len`` and in transformers
whenever ``rope_scaling`` says yarn, whose factor stretches ``original_max_position_embeddings``
to ``max_position_embeddings``; so a YaRN model exports ``max(max_seq_len, factor x original)``
positions and reads back that many. transformers normalizes the latent ``q_a_layernorm`` and
``kv_a_layernorm`` with eps 1e-6 whatever ``rms_norm_eps`` says (``model.latent_norm_eps``).
"""

import math
from typing import Any

import torch
from torch import Tensor

from titan_lightning.checkpoint import Source
from titan_lightning.config import ConfigError
from titan_lightning.models.common.hf_checkpoint import BLOCK_KEYS, EXPERT_KEYS, StateDictAdapter
from titan_lightning.models.common.hf_config import HFConfig, decoder_fields, scaling_fields
from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.common.safetensors_io import HFTensors
from titan_lightning.models.deepseek_v3.model import DeepSeekV3Args

HF_LATENT_NORM_EPS = 1e-6
# config.json fields that must hold the one value implemented here (absent: transformers' default, the same).
FIXED_FIELDS = {"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "rope_interleave": True,
                "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
# Fields that change nothing the model computes: training-only auxiliary losses, DeepSeek's remote
# code and expert placement, transformers' unused TP hint, multi-token-prediction layers (not built;
# their weights are skipped on load).
IGNORED_FIELDS = ("aux_loss_alpha", "seq_aux", "auto_map", "ep_size", "pretraining_tp", "num_nextn_predict_layers",
                  "num_mtp_layers")
_YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
# The one quantization_config read (the published DeepSeek V3 / R1 checkpoints').
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                    "activation_scheme": "dynamic"}
FP8_BLOCK = tuple(FP8_QUANTIZATION["weight_block_size"])
SCALE_SUFFIX = "_scale_inv"


class DeepSeekV3StateDictAdapter(StateDictAdapter):
    """Converts between ``Transformer(args)`` state dicts and Hugging Face DeepseekV3ForCausalLM ones."""

    family = "DeepSeek V3"
    layer_keys = {
        **BLOCK_KEYS,
        "attention.wq_a.weight": "self_attn.q_a_proj.weight",
        "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attention.wq_b.weight": "self_attn.q_b_proj.weight",
        "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "moe.router.gate.weight": "mlp.gate.weight",
        "moe.expert_bias": "mlp.gate.e_score_correction_bias",
        "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
        "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
        "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    }
    expert_keys = EXPERT_KEYS
    extra_from_hf = {
        "mlp.experts.gate_up_proj": lambda t: dict(zip(("moe.experts.w1", "moe.experts.w3"), t.chunk(2, dim=1))),
        "mlp.experts.down_proj": lambda t: {"moe.experts.w2": t},
    }
    ignored_hf_suffixes = ("rotary_emb.inv_freq",)
    ignores_layers_past_n_layers = True
    hf_model_types = ("deepseek_v3",)
    args_class, architecture = DeepSeekV3Args, "DeepseekV3ForCausalLM"
    fixed_fields = FIXED_FIELDS
    config_fields = {"vocab_size": "vocab_size", "dim": "hidden_size", "inter_dim": "intermediate_size",
                     "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "norm_eps": "rms_norm_eps"}

    def sources(self, tensors: HFTensors) -> dict[str, Source]:
        return super().sources(dequantized(tensors))

    @classmethod
    def read_fields(cls, config: HFConfig) -> dict[str, Any]:
        """Sizes are required; other absent fields take transformers' DeepseekV3Config defaults."""
        config.ignore(*IGNORED_FIELDS)
        quantization = config.get("quantization_config", default=None)
        if quantization is not None:
            check_fp8_quantization(quantization, config)
        nope, rope = config.get("qk_nope_head_dim"), config.get("qk_rope_head_dim")
        # Derived by transformers (head_dim: the rotary part of a head); config.json may repeat them.
        config.expect("head_dim", rope)
        config.expect("qk_head_dim", nope + rope)
        fields = decoder_fields(config, cls.config_fields, norm_eps=1e-6)
        eps = fields["norm_eps"]
        moe = MoEArgs(
            num_experts=config.get("n_routed_experts", "num_local_experts"),
            hidden_dim=config.get("moe_intermediate_size"), num_shared_experts=config.get("n_shared_experts"),
            top_k=config.get("num_experts_per_tok", default=8),
            score_func="sigmoid", route_norm=bool(config.get("norm_topk_prob", default=True)),
            route_scale=float(config.get("routed_scaling_factor", default=2.5)),
            num_groups=config.get("n_group", default=8), top_k_groups=config.get("topk_group", default=4),
        )  # fmt: skip
        return dict(
            fields, n_dense_layers=config.get("first_k_dense_replace"),
            n_kv_heads=config.get("num_key_value_heads", default=fields["n_heads"]),
            latent_norm_eps=None if eps == HF_LATENT_NORM_EPS else HF_LATENT_NORM_EPS,
            q_lora_rank=config.get("q_lora_rank") or 0, kv_lora_rank=config.get("kv_lora_rank"),
            qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=config.get("v_head_dim"), moe=moe,
            **rope_args(config),
        )  # fmt: skip

    @classmethod
    def check_expressible(cls, args: DeepSeekV3Args) -> None:
        m = args.moe
        if m.score_func != "sigmoid":
            raise ConfigError(f"model.moe.score_func={m.score_func!r}: Hugging Face DeepSeek V3 scores experts with "
                              f"'sigmoid' only")
        if m.score_before_experts:
            raise ConfigError("model.moe.score_before_experts=True: Hugging Face DeepSeek V3 weights the experts' "
                              "outputs; export needs False")
        if args.latent_eps != HF_LATENT_NORM_EPS:
            raise ConfigError(f"model.latent_norm_eps={args.latent_norm_eps} (latent norms at eps {args.latent_eps}): "
                              f"Hugging Face DeepSeek V3 uses {HF_LATENT_NORM_EPS} there; export needs "
                              f"model.latent_norm_eps={HF_LATENT_NORM_EPS}")
        if args.uses_yarn and not args.rope_factor > 1:
            raise ConfigError(f"model.rope_factor={args.rope_factor}: Hugging Face YaRN stretches RoPE by a "
                              f"factor > 1")

    @classmethod
    def write_rope(cls, args: DeepSeekV3Args) -> dict[str, Any]:
        """YaRN's positions: ``max(max_seq_len, factor x original)`` (the module docstring says why)."""
        if not args.uses_yarn:
            return {"max_position_embeddings": args.max_seq_len, "rope_theta": args.rope_theta, "rope_scaling": None}
        return {"max_position_embeddings": max(args.max_seq_len, round(args.rope_factor * args.original_seq_len)),
                "rope_theta": args.rope_theta, "rope_scaling": {
                    "rope_type": "yarn", "factor": args.rope_factor,
                    "original_max_position_embeddings": args.original_seq_len, "beta_fast": args.beta_fast,
                    "beta_slow": args.beta_slow, "mscale": args.mscale, "mscale_all_dim": args.mscale}}

    @classmethod
    def write_fields(cls, args: DeepSeekV3Args) -> dict[str, Any]:
        m = args.moe
        return dict(
            moe_intermediate_size=m.hidden_dim, first_k_dense_replace=args.n_dense_layers,
            num_key_value_heads=args.n_heads, q_lora_rank=args.q_lora_rank or None,
            kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
            n_routed_experts=m.num_experts, n_shared_experts=m.num_shared_experts, num_experts_per_tok=m.top_k,
            n_group=m.num_groups, topk_group=m.top_k_groups, norm_topk_prob=m.route_norm,
            routed_scaling_factor=m.route_scale, num_nextn_predict_layers=0,
        )  # fmt: skip


def rope_args(config: HFConfig) -> dict[str, Any]:
    """Our RoPE fields for config.json's: plain RoPE over ``max_position_embeddings``, or YaRN."""
    theta, scaling = config.rope()
    positions = config.get("max_position_embeddings", default=4096)
    if scaling is None:  # original_seq_len = max_seq_len: YaRN off
        return dict(rope_theta=theta, max_seq_len=positions, original_seq_len=positions)
    where = f"{config.source}: {'rope_parameters' if 'rope_parameters' in config.values else 'rope_scaling'}"
    if scaling.get("type") == scaling["rope_type"]:  # transformers 5 writes both spellings
        del scaling["type"]
    if scaling.get("truncate") is True:  # transformers' default; false is refused below
        del scaling["truncate"]
    yarn = scaling_fields({"beta_fast": 32, "beta_slow": 1, **scaling}, "yarn", _YARN, where)
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
    if not factor > 1:
        raise ConfigError(f"{where}: factor={factor}; YaRN here needs a factor > 1")
    if yarn["mscale"] != yarn["mscale_all_dim"]:
        raise ConfigError(f"{where}: mscale={yarn['mscale']} and mscale_all_dim={yarn['mscale_all_dim']} differ: "
                          f"transformers then scales the rotary features alone, which is not modelled here "
                          f"(supported: equal values)")
    return dict(
        rope_theta=theta, original_seq_len=original, rope_factor=float(factor), beta_fast=float(yarn["beta_fast"]),
        beta_slow=float(yarn["beta_slow"]), mscale=float(yarn["mscale"]),
        # our YaRN is on past original_seq_len positions, transformers' always
        max_seq_len=positions if positions > original else round(factor * original),
    )  # fmt: skip


def check_fp8_quantization(quantization: Any, config: HFConfig) -> None:
    """``quantization_config`` is the block-scaled FP8 of the published checkpoints (dequantized on load)."""
    fields = HFConfig(quantization if isinstance(quantization, dict) else {}, f"{config.source}: quantization_config",
                      config.family)
    fields.get("quant_method")
    for name, value in FP8_QUANTIZATION.items():
        fields.expect(name, value)
    fields.finish()


def dequantized(tensors: HFTensors, block: tuple[int, int] = FP8_BLOCK) -> HFTensors:
    """``tensors`` as the model reads them: each ``*.weight`` with a ``*.weight_scale_inv`` is its
    float8_e4m3fn values times the float32 scale of their ``block`` (edge blocks cropped), in
    float32; the scales are hidden. A block read reads only the scales over it. The scales' shapes
    are checked from the headers, dtypes on read; one-line errors name the Hugging Face key."""
    names = set(tensors.keys())
    scales = {}
    for name in tensors.keys():
        if not name.endswith(SCALE_SUFFIX):
            continue
        weight = name.removesuffix(SCALE_SUFFIX)
        if weight not in names:
            raise ValueError(f"{name}: a block scale without its weight {weight}")
        shape = tensors.shape(weight)
        if len(shape) != 2:
            raise ValueError(f"{name}: block scales for {weight} of shape {list(shape)}; they need a matrix")
        tiles = tuple(math.ceil(n / b) for n, b in zip(shape, block))
        if tensors.shape(name) != tiles:
            raise ValueError(f"{name} has shape {list(tensors.shape(name))}, expected {list(tiles)} (one scale per "
                             f"{block[0]}x{block[1]} block of the {list(shape)} weight)")
        scales[weight] = name

    def read(name: str, index: tuple[slice, ...]) -> Tensor:
        value = tensors.read(name, index)
        if name in scales:
            if value.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{scales[name]}: a block scale, but {name} is {value.dtype}, not float8_e4m3fn")
            return value.float() * _scales_over(tensors, scales[name], tensors.shape(name), index, block)
        if value.dtype == torch.float8_e4m3fn:
            raise ValueError(f"{name} is float8_e4m3fn but {name}{SCALE_SUFFIX} is missing (one float32 scale "
                             f"per {block[0]}x{block[1]} block)")
        if value.dtype.is_floating_point and value.element_size() == 1:
            raise ValueError(f"{name} is {value.dtype}; only float8_e4m3fn weights with block scales are read")
        return value

    return HFTensors({name: tensors.shape(name) for name in tensors.keys() if not name.endswith(SCALE_SUFFIX)}, read)


def _scales_over(tensors: HFTensors, scale: str, shape: tuple[int, ...], index: tuple[slice, ...],
                 block: tuple[int, int]) -> Tensor:
    """The block scales ``scale`` spread over each element of the weight's block ``index``."""
    (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip((*index, slice(None), slice(None)), shape))
    tiles = tensors.read(scale, (slice(r0 // block[0], math.ceil(r1 / block[0])),
                                 slice(c0 // block[1], math.ceil(c1 / block[1]))))
    spread = tiles.float().repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    first_row, first_col = r0 % block[0], c0 % block[1]
    return spread[first_row:first_row + r1 - r0, first_col:first_col + c1 - c0]
