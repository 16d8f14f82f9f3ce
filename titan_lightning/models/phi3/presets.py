"""Phi-3 and Phi-4 sizes: the debugmodel for tests, and the published shapes as in their Hugging
Face configs: Phi-3-mini (3.8B; 4k with a 2047-token sliding window, 128k with LongRoPE),
Phi-3-medium (14B, 4k), Phi-4 (14B, 16k, model_type phi3) and Phi-4-mini (3.8B, LongRoPE over the
first 96 of 128 features of each head, tied embeddings).

The 128k models' LongRoPE factors are long lists published with each checkpoint; a preset carries
the shape, and a run of such a checkpoint reads its factors from its config.json
(``recipes.hf:pretrained``). The presets here train without LongRoPE, at their original length.

Embeddings and output are never tied here (Qwen 2's rule, models/qwen2/presets.py): Phi-4-mini's
folder loads with ``Phi3StateDictAdapter(args, tie_word_embeddings=True)``, the output a copy.
"""

import copy

from titan_lightning.models.phi3.model import Phi3Args

_MINI = dict(dim=3072, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=96, ffn_hidden_dim=8192, vocab_size=32064,
             norm_eps=1e-5, rope_theta=10000.0)
_14B = dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=10, head_dim=128, ffn_hidden_dim=17920, norm_eps=1e-5)

PHI3_PRESETS: dict[str, Phi3Args] = {
    # torchtitan's debugmodel shape (dim 256, 16 heads, vocab 2048) with 8 KV heads, 6 layers; RoPE on
    # 12 of each head's 16 features (Phi-4-mini's 3/4).
    "debugmodel": Phi3Args(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=16, rotary_dim=12,
                           ffn_hidden_dim=768, vocab_size=2048, max_seq_len=4096),
    "mini-4k": Phi3Args(max_seq_len=4096, sliding_window=2047, **_MINI),
    "medium-4k": Phi3Args(vocab_size=32064, rope_theta=10000.0, max_seq_len=4096, sliding_window=2047, **_14B),
    "phi-4": Phi3Args(vocab_size=100352, rope_theta=250000.0, max_seq_len=16384, **_14B),
    "phi-4-mini": Phi3Args(dim=3072, n_layers=32, n_heads=24, n_kv_heads=8, head_dim=128, rotary_dim=96,
                           ffn_hidden_dim=8192, vocab_size=200064, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096),
}


def phi3_args(flavor: str) -> Phi3Args:
    """A fresh copy of the preset ``flavor``."""
    if flavor not in PHI3_PRESETS:
        raise ValueError(f"unknown phi3 flavor {flavor!r}; valid flavors: {', '.join(PHI3_PRESETS)}")
    return copy.deepcopy(PHI3_PRESETS[flavor])
