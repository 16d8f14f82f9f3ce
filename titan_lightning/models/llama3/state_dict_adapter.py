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
# config.json fields that must hold the one value implemented here.
FIXED_FIELDS = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "attention_dropout": 0.0,
                "pretraining_tp": 1}


class Llama3StateDictAdapter(StateDictAdapter):
    """Our Llama 3 state dict <-> a Hugging Face Llama one. ``tie_word_embeddings``: Llama 3.2
    1B/3B tie ``lm_head`` to the embeddings."""

    family = "Llama"
    layer_keys = LLAMA_BLOCK_KEYS
    rope_halves = HALF_ROTATED
    hf_model_types = ("llama",)

    @classmethod
    def args_from_hf_config(cls, config: HFConfig) -> Llama3Args:
        for name, value in FIXED_FIELDS.items():
            config.expect(name, value)
        dim, heads = config.get("hidden_size"), config.get("num_attention_heads")
        config.expect("head_dim", dim // heads, None)  # our Llama's heads are dim / n_heads wide
        theta, scaling = config.rope()
        return Llama3Args(
            vocab_size=config.get("vocab_size"), dim=dim, n_layers=config.get("num_hidden_layers"), n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads", default=heads), ffn_dim=config.get("intermediate_size"),
            norm_eps=config.get("rms_norm_eps"), rope_theta=theta, max_seq_len=config.get("max_position_embeddings"),
            rope_scaling=None if scaling is None else RopeScaling(
                **scaling_fields(scaling, "llama3", _LLAMA3_SCALING, config.source)),
        )

    @classmethod
    def hf_config(cls, args: Llama3Args) -> dict[str, Any]:
        s = args.rope_scaling
        return dict(
            architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=args.vocab_size,
            hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim, num_hidden_layers=args.n_layers,
            num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
            rms_norm_eps=args.norm_eps, max_position_embeddings=args.max_seq_len, rope_theta=args.rope_theta,
            rope_scaling=None if s is None else {"rope_type": "llama3", **{f: getattr(s, f) for f in _LLAMA3_SCALING}},
            **FIXED_FIELDS,
        )
