"""Mistral and Mixtral sizes: the debug models for tests, and the published shapes of Mistral 7B
v0.3 and Mistral Nemo 12B (2407), Mixtral 8x7B and 8x22B (v0.1), as in their Hugging Face configs:
GQA with 8 KV heads of 128 features, rope_theta 1e6, RMSNorm eps 1e-5, no sliding window.

Mixtral routes each token to 2 of 8 experts by softmax scores renormalized over the 2, with no
shared expert; the presets keep torchtitan's auxiliary-loss-free expert bias
(``load_balance_coeff``) for training from scratch. A model read from a Hugging Face folder trains
without it (Mixtral's checkpoint has no place for it; models/mistral/model.py).
"""

import copy

from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.mistral.model import MistralArgs

_MISTRAL = dict(n_kv_heads=8, head_dim=128, norm_eps=1e-5, rope_theta=1000000.0)


def _moe(*, hidden_dim: int, num_experts: int = 8, top_k: int = 2) -> MoEArgs:
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, num_shared_experts=0,
                   score_func="softmax", route_norm=True, load_balance_coeff=1e-3)


MISTRAL_PRESETS: dict[str, MistralArgs] = {
    # torchtitan's debugmodel shape (dim 256, 16 heads, vocab 2048), 8 KV heads, 6 layers.
    "debugmodel": MistralArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=16, ffn_hidden_dim=768,
                              vocab_size=2048, max_seq_len=4096),
    # Mixtral-shaped: 8 experts, top-2, on 4 layers.
    "debugmodel_moe": MistralArgs(dim=256, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=16, ffn_hidden_dim=256,
                                  vocab_size=2048, max_seq_len=4096, moe=_moe(hidden_dim=256)),
    "7B": MistralArgs(dim=4096, n_layers=32, n_heads=32, ffn_hidden_dim=14336, vocab_size=32768, max_seq_len=32768,
                      **_MISTRAL),
    # Nemo: 32 heads of 128 = 4096 query features on dim 5120.
    "Nemo-12B": MistralArgs(dim=5120, n_layers=40, n_heads=32, ffn_hidden_dim=14336, vocab_size=131072,
                            max_seq_len=128000, **_MISTRAL),
    "8x7B": MistralArgs(dim=4096, n_layers=32, n_heads=32, ffn_hidden_dim=14336, vocab_size=32000, max_seq_len=32768,
                        moe=_moe(hidden_dim=14336), **_MISTRAL),
    "8x22B": MistralArgs(dim=6144, n_layers=56, n_heads=48, ffn_hidden_dim=16384, vocab_size=32000, max_seq_len=65536,
                         moe=_moe(hidden_dim=16384), **_MISTRAL),
}


def mistral_args(flavor: str) -> MistralArgs:
    """A fresh copy of the preset ``flavor``."""
    if flavor not in MISTRAL_PRESETS:
        raise ValueError(f"unknown mistral flavor {flavor!r}; valid flavors: {', '.join(MISTRAL_PRESETS)}")
    return copy.deepcopy(MISTRAL_PRESETS[flavor])
