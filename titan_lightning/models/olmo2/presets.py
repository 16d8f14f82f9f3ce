"""OLMo 2 sizes: the debugmodel for tests, and the published shapes of the base models as in their
Hugging Face configs (OLMo-2-0425-1B, OLMo-2-1124-7B and -13B, OLMo-2-0325-32B): post-norm blocks,
QK-norm over whole projections, RMSNorm eps 1e-6, rope_theta 5e5, 4096 positions, vocabulary
100,352; multi-head attention up to 13B, 8 KV heads in 32B. Embeddings and output are untied.
"""

import copy

from titan_lightning.models.olmo2.model import Olmo2Args

_OLMO2 = dict(head_dim=128, norm_eps=1e-6, rope_theta=500000.0, max_seq_len=4096, vocab_size=100352)

OLMO2_PRESETS: dict[str, Olmo2Args] = {
    # torchtitan's debugmodel shape (dim 256, 16 heads, vocab 2048) with 8 KV heads, 6 layers.
    "debugmodel": Olmo2Args(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=16, ffn_hidden_dim=768,
                            vocab_size=2048, max_seq_len=4096),
    "1B": Olmo2Args(dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, ffn_hidden_dim=8192, **_OLMO2),
    "7B": Olmo2Args(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden_dim=11008, **_OLMO2),
    "13B": Olmo2Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_hidden_dim=13824, **_OLMO2),
    "32B": Olmo2Args(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_hidden_dim=27648, **_OLMO2),
}


def olmo2_args(flavor: str) -> Olmo2Args:
    """A fresh copy of the preset ``flavor``."""
    if flavor not in OLMO2_PRESETS:
        raise ValueError(f"unknown olmo2 flavor {flavor!r}; valid flavors: {', '.join(OLMO2_PRESETS)}")
    return copy.deepcopy(OLMO2_PRESETS[flavor])
