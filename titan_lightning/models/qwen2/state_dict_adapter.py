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

_BIASES = {"attention.wq.bias": "self_attn.q_proj.bias", "attention.wk.bias": "self_attn.k_proj.bias",
           "attention.wv.bias": "self_attn.v_proj.bias"}


class Qwen2StateDictAdapter(StateDictAdapter):
    """Our Qwen 2 state dict <-> a Hugging Face Qwen2 one. ``tie_word_embeddings``: the 0.5B, 1.5B
    and 3B models tie ``lm_head`` to the embeddings."""

    family = "Qwen2"
    layer_keys = {**LLAMA_BLOCK_KEYS, **_BIASES}
    rope_halves = {**HALF_ROTATED, "attention.wq.bias": "n_heads", "attention.wk.bias": "n_kv_heads"}
    hf_model_types = ("qwen2",)
    args_class, architecture = Qwen2Args, "Qwen2ForCausalLM"
    fixed_fields = {"hidden_act": "silu", "attention_dropout": 0.0}

    @classmethod
    def read_fields(cls, config: HFConfig) -> dict[str, Any]:
        config.expect("use_mrope", False)  # Qwen2-VL's multimodal RoPE; false where a text config has it
        window, layer_types = sliding_window_fields(config, switch="use_sliding_window")
        return {**super().read_fields(config), "qkv_bias": True, "sliding_window": window, "layer_types": layer_types}

    @classmethod
    def write_fields(cls, args: Qwen2Args) -> dict[str, Any]:
        """The sliding-window fields: off, or on with each layer's attention named."""
        if not args.qkv_bias:
            raise ConfigError("model.qkv_bias=False: Hugging Face Qwen2 always has q/k/v biases; export needs True")
        types = [("sliding_attention" if args.attention_window(i) is not None else "full_attention")
                 for i in range(args.n_layers)]
        if "sliding_attention" not in types:
            return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers}
        return {"use_sliding_window": True, "sliding_window": args.sliding_window,
                "max_window_layers": types.index("sliding_attention"), "layer_types": types}
