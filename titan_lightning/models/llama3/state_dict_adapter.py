"""Llama 3 <-> Hugging Face ``LlamaForCausalLM`` state dicts.

The names are Qwen 3's without QK-norm (``model.embed_tokens``, ``model.layers.N.self_attn.
q_proj`` ..., ``mlp.gate_proj`` ..., ``lm_head``), and so is the RoPE layout: Hugging Face
rotates feature i with i + head_dim/2, we rotate adjacent pairs, so the q_proj and k_proj
rows are permuted within each head (models/qwen3/state_dict_adapter.py has the details).
"""

from titan_lightning.models.llama3.model import Llama3Args
from titan_lightning.models.qwen3.state_dict_adapter import _LAYER_KEYS, Qwen3StateDictAdapter


class Llama3StateDictAdapter(Qwen3StateDictAdapter):
    """Our Llama 3 state dict <-> a Hugging Face Llama one. ``tie_word_embeddings`` (Llama 3.2
    1B/3B tie ``lm_head`` to the embeddings): ``from_hf`` copies the embeddings into our untied
    output, ``to_hf`` writes no ``lm_head.weight`` and refuses an output that differs."""

    family = "Llama"
    layer_keys = {k: v for k, v in _LAYER_KEYS.items() if not k.startswith(("attention.q_norm", "attention.k_norm", "moe."))}
    expert_keys: dict[str, str] = {}

    def __init__(self, args: Llama3Args, *, tie_word_embeddings: bool = False):
        self.args = args
        self.tie_word_embeddings = tie_word_embeddings

    def _head_counts(self) -> dict[str, int]:
        return {"attention.wq.weight": self.args.n_heads, "attention.wk.weight": self.args.n_kv_heads}
