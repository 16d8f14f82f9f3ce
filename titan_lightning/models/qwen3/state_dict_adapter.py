"""Qwen 3 <-> Hugging Face ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``: state dicts and config.json.

Llama's names, QK-norm (``self_attn.q_norm``/``k_norm``, permuted per head like q_proj and k_proj:
it runs before RoPE, feature by feature) and, for MoE, the router (``mlp.gate``) and the experts.
Hugging Face's Qwen3-MoE routes by softmax top-k with no routing bias: ``moe.expert_bias`` has no
counterpart (models/common/hf_checkpoint.py), so a model read from a config.json trains without
one (``moe.load_balance_coeff=None``) and an export of one that trained a bias is refused.
"""

from typing import Any

from titan_lightning.config import ConfigError
from titan_lightning.models.common.hf_checkpoint import EXPERT_KEYS, HALF_ROTATED, LLAMA_BLOCK_KEYS, StateDictAdapter
from titan_lightning.models.common.hf_config import HFConfig, config_of, fields_of
from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.qwen3.model import Qwen3Args

MOE_FIXED_FIELDS = {"decoder_sparse_step": 1, "mlp_only_layers": []}
# MoEArgs fields -> config.json's.
_MOE_FIELDS = {"num_experts": ("num_experts", "num_local_experts"), "top_k": "num_experts_per_tok",
               "hidden_dim": "moe_intermediate_size", "route_norm": "norm_topk_prob"}


class Qwen3StateDictAdapter(StateDictAdapter):
    """Our Qwen 3 state dict <-> a Hugging Face Qwen3 / Qwen3-MoE one. ``tie_word_embeddings``: the
    0.6B, 1.7B and 4B models tie ``lm_head`` to the embeddings."""

    family = "Qwen3"
    layer_keys = {
        **LLAMA_BLOCK_KEYS,
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
        "moe.router.gate.weight": "mlp.gate.weight",
    }
    expert_keys = EXPERT_KEYS
    rope_halves = HALF_ROTATED
    hf_model_types = ("qwen3", "qwen3_moe")
    args_class, architecture = Qwen3Args, "Qwen3ForCausalLM"
    fixed_fields = {"attention_bias": False, "hidden_act": "silu", "attention_dropout": 0.0,
                    "use_sliding_window": False}

    def __init__(self, args: Qwen3Args, *, tie_word_embeddings: bool = False):
        super().__init__(args, tie_word_embeddings=tie_word_embeddings)
        if args.moe is not None and args.moe.num_shared_experts:
            raise ValueError(f"model.moe.num_shared_experts={args.moe.num_shared_experts}: Hugging Face Qwen3-MoE "
                             f"has no shared experts; use 0")

    @classmethod
    def read_fields(cls, config: HFConfig) -> dict[str, Any]:
        # Sliding windows are off (use_sliding_window false): their sizes change nothing.
        config.ignore("sliding_window", "max_window_layers")
        config.expect("layer_types", None, ["full_attention"] * config.get("num_hidden_layers"))
        fields = super().read_fields(config)
        moe = None
        if config.get("model_type") == "qwen3_moe":
            for name, value in MOE_FIXED_FIELDS.items():
                config.expect(name, value)
            config.ignore("router_aux_loss_coef")  # a training loss weight; no routing bias here instead
            moe = fields_of(config, _MOE_FIELDS, route_norm=False)
            moe = MoEArgs(**moe | {"route_norm": bool(moe["route_norm"])}, score_func="softmax",
                          load_balance_coeff=None)
        return {**fields, "qk_norm": True, "moe": moe}

    @classmethod
    def check_expressible(cls, args: Qwen3Args) -> None:
        if not args.qk_norm:
            raise ConfigError("model.qk_norm=False: Hugging Face Qwen3 always normalizes q and k; export needs True")
        m = args.moe
        if m is not None and (m.score_func != "softmax" or m.route_scale != 1.0 or m.score_before_experts
                              or m.num_shared_experts):
            raise ConfigError(f"model.moe={m}: Hugging Face Qwen3-MoE routes by softmax top-k, scale 1, scores "
                              f"after the experts, no shared experts")

    @classmethod
    def write_fields(cls, args: Qwen3Args) -> dict[str, Any]:
        m = args.moe
        if m is None:
            return {}
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **config_of(m, _MOE_FIELDS),
                **MOE_FIXED_FIELDS}
