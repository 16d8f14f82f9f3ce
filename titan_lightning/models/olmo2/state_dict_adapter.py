"""OLMo 2 <-> Hugging Face ``Olmo2ForCausalLM``: state dicts and config.json.

Llama's projection names; the norms are OLMo 2's: ``post_attention_layernorm`` and
``post_feedforward_layernorm`` (after their sublayer), ``self_attn.q_norm`` / ``k_norm`` over the
whole projections, whose weights are permuted per head between the two RoPE layouts like the rows
of ``q_proj`` / ``k_proj`` (a norm over all the features does not mind their order).
"""

from typing import Any

from titan_lightning.config import ConfigError
from titan_lightning.models.common.hf_checkpoint import StateDictAdapter
from titan_lightning.models.common.hf_config import HFConfig
from titan_lightning.models.olmo2.model import Olmo2Args

# config.json fields that must hold the one value implemented here.
FIXED_FIELDS = {"hidden_act": "silu", "attention_dropout": 0.0, "attention_bias": False}
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

    @classmethod
    def args_from_hf_config(cls, config: HFConfig) -> Olmo2Args:
        for name, value in FIXED_FIELDS.items():
            config.expect(name, value)
        theta, scaling = config.rope()
        if scaling is not None:
            raise ConfigError(f"{config.source}: RoPE scaling {scaling} is not modelled for Olmo2 here "
                              f"(supported: none)")
        dim, heads = config.get("hidden_size"), config.get("num_attention_heads")
        return Olmo2Args(
            vocab_size=config.get("vocab_size"), dim=dim, n_layers=config.get("num_hidden_layers"), n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads", default=heads),
            head_dim=config.get("head_dim", default=dim // heads), ffn_hidden_dim=config.get("intermediate_size"),
            norm_eps=config.get("rms_norm_eps"), rope_theta=theta, max_seq_len=config.get("max_position_embeddings"),
        )

    @classmethod
    def check_expressible(cls, args: Olmo2Args) -> None:
        if args.sliding_window is not None:
            raise ConfigError(f"model.sliding_window={args.sliding_window}: Hugging Face Olmo2 has no sliding "
                              f"window; export needs model.sliding_window=None")

    @classmethod
    def hf_config(cls, args: Olmo2Args) -> dict[str, Any]:
        cls.check_expressible(args)
        return dict(
            architectures=["Olmo2ForCausalLM"], model_type="olmo2", vocab_size=args.vocab_size, hidden_size=args.dim,
            intermediate_size=args.ffn_hidden_dim, num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
            num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim, rms_norm_eps=args.norm_eps,
            max_position_embeddings=args.max_seq_len, rope_theta=args.rope_theta, rope_scaling=None, **FIXED_FIELDS,
        )
