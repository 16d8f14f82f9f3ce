"""Llama 3 <-> Hugging Face ``LlamaForCausalLM``: state dicts (``model.embed_tokens``,
``model.layers.N.self_attn.q_proj`` ..., ``mlp.gate_proj`` ..., ``lm_head``; the q_proj and k_proj
rows permuted per head between the two RoPE layouts, models/common/hf_checkpoint.py) and config.json.
"""

from typing import Any

from titan_lightning.models.common.hf_checkpoint import HALF_ROTATED, LLAMA_BLOCK_KEYS, StateDictAdapter
from titan_lightning.models.common.hf_config import HFConfig, scaling_fields
from titan_lightning.models.common.rope import RopeScaling
from titan_lightning.models.llama3.model import Llama3Args

_LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class Llama3StateDictAdapter(StateDictAdapter):
    """Our Llama 3 state dict <-> a Hugging Face Llama one. ``tie_word_embeddings``: Llama 3.2
    1B/3B tie ``lm_head`` to the embeddings."""

    family = "Llama"
    layer_keys = LLAMA_BLOCK_KEYS
    rope_halves = HALF_ROTATED
    hf_model_types = ("llama",)
    args_class, architecture = Llama3Args, "LlamaForCausalLM"
    fixed_fields = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "attention_dropout": 0.0,
                    "pretraining_tp": 1}

    @classmethod
    def read_fields(cls, config: HFConfig) -> dict[str, Any]:
        fields = super().read_fields(config)
        config.expect("head_dim", fields["dim"] // fields["n_heads"], None)  # our Llama's heads are dim / n_heads wide
        del fields["head_dim"]
        fields["ffn_dim"] = fields.pop("ffn_hidden_dim")
        return fields

    @classmethod
    def read_rope(cls, config: HFConfig) -> dict[str, Any]:
        theta, scaling = config.rope()
        return {"rope_theta": theta, "rope_scaling": None if scaling is None else RopeScaling(
            **scaling_fields(scaling, "llama3", _LLAMA3_SCALING, config.source))}

    @classmethod
    def write_rope(cls, args: Llama3Args) -> dict[str, Any]:
        s = args.rope_scaling
        return {"rope_theta": args.rope_theta, "rope_scaling": None if s is None else {
            "rope_type": "llama3", **{f: getattr(s, f) for f in _LLAMA3_SCALING}}}
