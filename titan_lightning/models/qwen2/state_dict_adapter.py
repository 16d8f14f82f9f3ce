"""Qwen 2 / 2.5 <-> Hugging Face ``Qwen2ForCausalLM``: state dicts and config.json.

Llama's names plus the q/k/v biases (``self_attn.q_proj.bias`` ...); the q and k biases are
permuted per head between the two RoPE layouts like the rows of their weights. A config that turns
``use_sliding_window`` on slides the layers from ``max_window_layers`` on (or those ``layer_types``
names): ``model.sliding_window`` and ``model.layer_types``.
"""

from typing import Any

from titan_lightning.config import ConfigError
from titan_lightning.models.common.hf_checkpoint import HALF_ROTATED, LLAMA_BLOCK_KEYS, StateDictAdapter
from titan_lightning.models.common.hf_config import HFConfig, sliding_window_fields
from titan_lightning.models.qwen2.model import Qwen2Args

# config.json fields that must hold the one value implemented here.
FIXED_FIELDS = {"hidden_act": "silu", "attention_dropout": 0.0}
_BIASES = {"attention.wq.bias": "self_attn.q_proj.bias", "attention.wk.bias": "self_attn.k_proj.bias",
           "attention.wv.bias": "self_attn.v_proj.bias"}


class Qwen2StateDictAdapter(StateDictAdapter):
    """Our Qwen 2 state dict <-> a Hugging Face Qwen2 one. ``tie_word_embeddings``: the 0.5B, 1.5B
    and 3B models tie ``lm_head`` to the embeddings."""

    family = "Qwen2"
    layer_keys = {**LLAMA_BLOCK_KEYS, **_BIASES}
    rope_halves = {**HALF_ROTATED, "attention.wq.bias": "n_heads", "attention.wk.bias": "n_kv_heads"}
    hf_model_types = ("qwen2",)

    @classmethod
    def args_from_hf_config(cls, config: HFConfig) -> Qwen2Args:
        for name, value in FIXED_FIELDS.items():
            config.expect(name, value)
        config.expect("use_mrope", False)  # Qwen2-VL's multimodal RoPE; false where a text config has it
        window, layer_types = sliding_window_fields(config, switch="use_sliding_window")
        theta, scaling = config.rope()
        if scaling is not None:
            raise ConfigError(f"{config.source}: RoPE scaling {scaling} is not modelled for Qwen2 here "
                              f"(supported: none)")
        dim, heads = config.get("hidden_size"), config.get("num_attention_heads")
        return Qwen2Args(
            vocab_size=config.get("vocab_size"), dim=dim, n_layers=config.get("num_hidden_layers"), n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads", default=heads),
            head_dim=config.get("head_dim", default=dim // heads), ffn_hidden_dim=config.get("intermediate_size"),
            norm_eps=config.get("rms_norm_eps"), rope_theta=theta, max_seq_len=config.get("max_position_embeddings"),
            qkv_bias=True, sliding_window=window, layer_types=layer_types,
        )

    @classmethod
    def hf_config(cls, args: Qwen2Args) -> dict[str, Any]:
        if not args.qkv_bias:
            raise ConfigError("model.qkv_bias=False: Hugging Face Qwen2 always has q/k/v biases; export needs True")
        return dict(
            architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=args.vocab_size, hidden_size=args.dim,
            intermediate_size=args.ffn_hidden_dim, num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
            num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim, rms_norm_eps=args.norm_eps,
            max_position_embeddings=args.max_seq_len, rope_theta=args.rope_theta, rope_scaling=None,
            **_window_fields(args), **FIXED_FIELDS,
        )


def _window_fields(args: Qwen2Args) -> dict[str, Any]:
    """config.json's sliding-window fields: off, or on with each layer's attention named."""
    types = [("sliding_attention" if args.attention_window(i) is not None else "full_attention")
             for i in range(args.n_layers)]
    if "sliding_attention" not in types:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers}
    return {"use_sliding_window": True, "sliding_window": args.sliding_window,
            "max_window_layers": types.index("sliding_attention"), "layer_types": types}
