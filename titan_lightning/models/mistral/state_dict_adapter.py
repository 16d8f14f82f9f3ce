"""Mistral / Mixtral <-> Hugging Face ``MistralForCausalLM`` / ``MixtralForCausalLM``: state dicts
and config.json. ``sliding_window`` (one window for every layer, as transformers applies it) maps
onto ``model.sliding_window``.

Llama's names; Mixtral's experts as its checkpoints hold them (``block_sparse_moe.experts.J.w1``
/ ``w3`` / ``w2``: gate, up, down) and its router ``block_sparse_moe.gate``. Hugging Face Mixtral
routes by softmax top-2 renormalized, with no routing bias: ``moe.expert_bias`` has no counterpart
(models/common/hf_checkpoint.py), so a model read from a config.json trains without one
(``moe.load_balance_coeff=None``) and an export of one that trained a bias is refused.
"""

from typing import Any

from titan_lightning.config import ConfigError
from titan_lightning.models.common.hf_checkpoint import HALF_ROTATED, LLAMA_BLOCK_KEYS, StateDictAdapter
from titan_lightning.models.common.hf_config import HFConfig, sliding_window_fields, uniform_sliding_window
from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.mistral.model import MistralArgs

MOE_FIXED_FIELDS = {"router_jitter_noise": 0.0}
# transformers' sliding_window when a config.json leaves it out (MistralConfig 4096, MixtralConfig None).
_DEFAULT_WINDOW = {"mistral": 4096, "mixtral": None}


class MistralStateDictAdapter(StateDictAdapter):
    """Our Mistral / Mixtral state dict <-> a Hugging Face Mistral / Mixtral one."""

    family = "Mistral"
    layer_keys = {**LLAMA_BLOCK_KEYS, "moe.router.gate.weight": "block_sparse_moe.gate.weight"}
    expert_keys = {"moe.experts.w1": "w1", "moe.experts.w3": "w3", "moe.experts.w2": "w2"}
    experts_prefix = "block_sparse_moe.experts"
    rope_halves = HALF_ROTATED
    hf_model_types = ("mistral", "mixtral")
    args_class, architecture = MistralArgs, "MistralForCausalLM"
    fixed_fields = {"hidden_act": "silu", "attention_dropout": 0.0}

    @classmethod
    def read_fields(cls, config: HFConfig) -> dict[str, Any]:
        model_type = config.get("model_type")
        window, _ = sliding_window_fields(config, default_window=_DEFAULT_WINDOW[model_type], per_layer=False)
        fields = super().read_fields(config)
        fields["head_dim"] = fields["head_dim"] or fields["dim"] // fields["n_heads"]  # Mixtral's null: dim / n_heads
        moe = None
        if model_type == "mixtral":
            for name, value in MOE_FIXED_FIELDS.items():
                config.expect(name, value)
            # The weight of Hugging Face's auxiliary load-balancing loss: not trained here, and no
            # routing bias instead (Mixtral's checkpoint has none), so routing is pure top-2.
            config.ignore("router_aux_loss_coef")
            moe = MoEArgs(num_experts=config.get("num_local_experts"), top_k=config.get("num_experts_per_tok"),
                          hidden_dim=fields["ffn_hidden_dim"], score_func="softmax", route_norm=True,
                          load_balance_coeff=None)
        return {**fields, "moe": moe, "sliding_window": window}

    @classmethod
    def check_expressible(cls, args: MistralArgs) -> None:
        uniform_sliding_window(args, "Hugging Face Mistral and Mixtral apply")

    @classmethod
    def write_fields(cls, args: MistralArgs) -> dict[str, Any]:
        window = {"sliding_window": uniform_sliding_window(args, "Hugging Face Mistral and Mixtral apply")}
        m = args.moe
        if m is None:
            return window
        if (m.score_func != "softmax" or not m.route_norm or m.route_scale != 1.0 or m.score_before_experts
                or m.num_shared_experts or m.num_groups != 1):
            raise ConfigError(f"model.moe={m}: Hugging Face Mixtral routes by softmax top-k renormalized, scale 1, "
                              f"scores after the experts, no shared experts, no expert groups")
        return {**window, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": m.hidden_dim, "num_local_experts": m.num_experts,
                "num_experts_per_tok": m.top_k, **MOE_FIXED_FIELDS}
