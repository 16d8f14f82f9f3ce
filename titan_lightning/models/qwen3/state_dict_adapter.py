"""Qwen 3 <-> Hugging Face ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` state dicts.

Llama's names, QK-norm (``self_attn.q_norm``/``k_norm``, permuted per head like q_proj and k_proj:
it runs before RoPE, feature by feature) and, for MoE, the router (``mlp.gate``) and the experts;
``moe.expert_bias`` has no Hugging Face counterpart (models/common/hf_checkpoint.py).
"""

from titan_lightning.models.common.hf_checkpoint import EXPERT_KEYS, HALF_ROTATED, LLAMA_BLOCK_KEYS, StateDictAdapter
from titan_lightning.models.qwen3.model import Qwen3Args


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

    def __init__(self, args: Qwen3Args, *, tie_word_embeddings: bool = False):
        super().__init__(args, tie_word_embeddings=tie_word_embeddings)
        if args.moe is not None and args.moe.num_shared_experts:
            raise ValueError(f"model.moe.num_shared_experts={args.moe.num_shared_experts}: Hugging Face Qwen3-MoE "
                             f"has no shared experts; use 0")
