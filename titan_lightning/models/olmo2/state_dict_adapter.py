"""OLMo 2 <-> Hugging Face ``Olmo2ForCausalLM``: state dicts and config.json.

Llama's projection names; the norms are OLMo 2's: ``post_attention_layernorm`` and
``post_feedforward_layernorm`` (after their sublayer), ``self_attn.q_norm`` / ``k_norm`` over the
whole projections, whose weights are permuted per head between the two RoPE layouts like the rows
of ``q_proj`` / ``k_proj`` (a norm over all the features does not mind their order).
"""

from titan_lightning.config import ConfigError
from titan_lightning.models.common.hf_checkpoint import StateDictAdapter
from titan_lightning.models.olmo2.model import Olmo2Args

_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}


class Olmo2StateDictAdapter(StateDictAdapter):
    """Our OLMo 2 state dict <-> a Hugging Face Olmo2 one."""

    family = "Olmo2"
    layer_keys = _LAYER_KEYS
    rope_halves = {"attention.wq.weight": "n_heads", "attention.wk.weight": "n_kv_heads",
                   "attention.q_norm.weight": "n_heads", "attention.k_norm.weight": "n_kv_heads"}
    hf_model_types = ("olmo2",)
    args_class, architecture = Olmo2Args, "Olmo2ForCausalLM"
    fixed_fields = {"hidden_act": "silu", "attention_dropout": 0.0, "attention_bias": False}

    @classmethod
    def check_expressible(cls, args: Olmo2Args) -> None:
        if args.sliding_window is not None:
            raise ConfigError(f"model.sliding_window={args.sliding_window}: Hugging Face Olmo2 has no sliding "
                              f"window; export needs model.sliding_window=None")
