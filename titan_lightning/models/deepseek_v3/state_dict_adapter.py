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
float32 ``*.weight_scale_inv`` per 128 x 128 block) are dequantized as they are read (models/common/quantized.py).

config.json: YaRN is on in our model when ``max_seq_len > original_seq_len`` and in transformers
whenever ``rope_scaling`` says yarn, whose factor stretches ``original_max_position_embeddings``
to ``max_position_embeddings``; so a YaRN model exports ``max(max_seq_len, factor x original)``
positions and reads back that many. transformers normalizes the latent ``q_a_layernorm`` and
``kv_a_layernorm`` with eps 1e-6 whatever ``rms_norm_eps`` says (``model.latent_norm_eps``).
"""

from typing import Any

from titan_lightning.checkpoint import Source
from titan_lightning.config import ConfigError
from titan_lightning.models.common.hf_checkpoint import BLOCK_KEYS, EXPERT_KEYS, StateDictAdapter
from titan_lightning.models.common.hf_config import HFConfig, config_of, decoder_fields, fields_of, scaling_fields
from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.common.quantized import FP8_QUANTIZATION, check_quantization
from titan_lightning.models.common.quantized import fp8_dequantized as dequantized
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
# MoEArgs fields -> config.json's.
_MOE_FIELDS = {"num_experts": ("n_routed_experts", "num_local_experts"), "hidden_dim": "moe_intermediate_size",
               "num_shared_experts": "n_shared_experts", "top_k": "num_experts_per_tok", "route_norm": "norm_topk_prob",
               "route_scale": "routed_scaling_factor", "num_groups": "n_group", "top_k_groups": "topk_group"}
_YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


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
    # PEFT (0.21, transformers 5) reads these in target_modules as the routed experts' tensors: the dense
    # and shared MLPs' linears take no LoRA adapters (lora/targets.py).
    peft_expert_names = ("gate_proj", "up_proj", "down_proj")
    hf_model_types = ("deepseek_v3",)
    args_class, architecture = DeepSeekV3Args, "DeepseekV3ForCausalLM"
    fixed_fields = FIXED_FIELDS
    config_fields = {"vocab_size": "vocab_size", "dim": "hidden_size", "inter_dim": "intermediate_size",
                     "n_layers": "num_hidden_layers", "n_dense_layers": "first_k_dense_replace",
                     "n_heads": "num_attention_heads", "norm_eps": "rms_norm_eps", "kv_lora_rank": "kv_lora_rank",
                     **{f: f for f in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}}

    def sources(self, tensors: HFTensors) -> dict[str, Source]:
        return super().sources(dequantized(tensors))

    @classmethod
    def read_fields(cls, config: HFConfig) -> dict[str, Any]:
        """Sizes are required; other absent fields take transformers' DeepseekV3Config defaults."""
        config.ignore(*IGNORED_FIELDS)
        quantization = config.get("quantization_config", default=None)
        if quantization is not None:
            check_quantization(quantization, config, FP8_QUANTIZATION)
        fields = decoder_fields(config, cls.config_fields, norm_eps=1e-6)
        # Derived by transformers (head_dim: the rotary part of a head); config.json may repeat them.
        config.expect("head_dim", fields["qk_rope_head_dim"])
        config.expect("qk_head_dim", fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"])
        moe = fields_of(config, _MOE_FIELDS, top_k=8, route_norm=True, route_scale=2.5, num_groups=8, top_k_groups=4)
        moe.update(route_norm=bool(moe["route_norm"]), route_scale=float(moe["route_scale"]))
        return dict(
            fields, n_kv_heads=config.get("num_key_value_heads", default=fields["n_heads"]),
            latent_norm_eps=None if fields["norm_eps"] == HF_LATENT_NORM_EPS else HF_LATENT_NORM_EPS,
            q_lora_rank=config.get("q_lora_rank") or 0, moe=MoEArgs(score_func="sigmoid", **moe), **rope_args(config),
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
        return {"num_key_value_heads": args.n_heads, "q_lora_rank": args.q_lora_rank or None,
                **config_of(args.moe, _MOE_FIELDS), "num_nextn_predict_layers": 0}


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


