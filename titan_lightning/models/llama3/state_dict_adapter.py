"""Llama 3 <-> Hugging Face ``LlamaForCausalLM`` state dicts: ``model.embed_tokens``,
``model.layers.N.self_attn.q_proj`` ..., ``mlp.gate_proj`` ..., ``lm_head``. The q_proj and k_proj
rows are permuted per head between the two RoPE layouts (models/common/hf_checkpoint.py).
"""

from titan_lightning.models.common.hf_checkpoint import HALF_ROTATED, LLAMA_BLOCK_KEYS, StateDictAdapter


class Llama3StateDictAdapter(StateDictAdapter):
    """Our Llama 3 state dict <-> a Hugging Face Llama one. ``tie_word_embeddings``: Llama 3.2
    1B/3B tie ``lm_head`` to the embeddings."""

    family = "Llama"
    layer_keys = LLAMA_BLOCK_KEYS
    rope_halves = HALF_ROTATED
