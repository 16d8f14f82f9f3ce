"""Qwen 3 <-> Hugging Face ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` state dicts.

Llama's names plus QK-norm (``self_attn.q_norm``/``k_norm``) and, for MoE, the router
(``mlp.gate``) and the per-expert ``mlp.experts.J.*_proj``, stacked here as ``moe.experts.w1/w3/w2``
[E, ...]. The q_proj/k_proj rows and the q_norm/k_norm weights are permuted per head between the
two RoPE layouts; ``moe.expert_bias`` has no Hugging Face counterpart (models/common/hf_checkpoint.py
has both).
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
            raise ValueError(
                f"model.moe.num_shared_experts={args.moe.num_shared_experts}: Hugging Face Qwen3-MoE has no "
                f"shared experts; use 0"
            )
