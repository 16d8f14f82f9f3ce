"""Llama 3 sizes: the debugmodel for tests, and the published shapes of Llama 3.2 (1B, 3B)
and Llama 3.1 (8B, 70B, 405B).

Embeddings and output are never tied. Hugging Face ties them for 1B and 3B; torchtitan
does not, and neither do we, so 1B has 1.50B parameters here (1.24B on its model card)
and 3B has 3.61B (3.21B).
"""

import copy

from titan_lightning.models.common import RopeScaling
from titan_lightning.models.llama3.model import Llama3Args



def _llama(dim: int, n_layers: int, n_heads: int, ffn_dim_multiplier: float, multiple_of: int, rope_factor: float):
    """A published size: 8 key/value heads, the 128K vocabulary and context, Llama 3.1's RoPE scaling."""
    return Llama3Args(dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim_multiplier=ffn_dim_multiplier,
                      multiple_of=multiple_of, rope_scaling=RopeScaling(factor=rope_factor), vocab_size=128256,
                      n_kv_heads=8, rope_theta=500000.0, max_seq_len=131072)


LLAMA3_PRESETS: dict[str, Llama3Args] = {
    # torchtitan's debugmodel, with its default Llama 3.1 RoPE scaling.
    "debugmodel": Llama3Args(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048, max_seq_len=2048),
    "1B": _llama(dim=2048, n_layers=16, n_heads=32, ffn_dim_multiplier=1.5, multiple_of=256, rope_factor=32.0),
    "3B": _llama(dim=3072, n_layers=28, n_heads=24, ffn_dim_multiplier=1.0, multiple_of=256, rope_factor=32.0),
    "8B": _llama(dim=4096, n_layers=32, n_heads=32, ffn_dim_multiplier=1.3, multiple_of=1024, rope_factor=8.0),
    "70B": _llama(dim=8192, n_layers=80, n_heads=64, ffn_dim_multiplier=1.3, multiple_of=4096, rope_factor=8.0),
    "405B": _llama(dim=16384, n_layers=126, n_heads=128, ffn_dim_multiplier=1.2, multiple_of=4096, rope_factor=8.0),
}


def llama3_args(flavor: str) -> Llama3Args:
    """A fresh copy of the preset ``flavor``."""
    if flavor not in LLAMA3_PRESETS:
        raise ValueError(f"unknown llama3 flavor {flavor!r}; valid flavors: {', '.join(LLAMA3_PRESETS)}")
    return copy.deepcopy(LLAMA3_PRESETS[flavor])
