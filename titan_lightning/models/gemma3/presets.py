"""Gemma 3 sizes: the debugmodel for tests, and the text models of the published sizes as in their
Hugging Face configs (``gemma3_text``; for 4B, 12B and 27B the ``text_config`` of the multimodal
release): GQA with head_dim 256 (128 for 27B), five sliding layers to one global, the window 512
(270M, 1B) or 1024, local RoPE base 10,000, global 1,000,000 with linear scaling 8 from 4B on;
vocabulary 262,144 (270M, 1B) or 262,208.

Embeddings and output are tied in every release; we never tie, so each size has ``vocab_size * dim``
more parameters here than on its model card (a folder loads with the output a copy of the
embeddings: models/gemma3/state_dict_adapter.py).
"""

import copy

from titan_lightning.models.gemma3.model import Gemma3Args, gemma3_layer_types


def _size(n_layers: int, **shape) -> Gemma3Args:
    return Gemma3Args(n_layers=n_layers, layer_types=gemma3_layer_types(n_layers), norm_eps=1e-6, rope_theta=1e6,
                      rope_local_theta=1e4, **shape)


_SMALL = dict(vocab_size=262144, sliding_window=512, max_seq_len=32768, n_heads=4, n_kv_heads=1, head_dim=256,
              query_pre_attn_scalar=256)
_LARGE = dict(vocab_size=262208, sliding_window=1024, max_seq_len=131072, rope_factor=8.0)

GEMMA3_PRESETS: dict[str, Gemma3Args] = {
    # torchtitan's debugmodel shape (dim 256, vocab 2048): 8 heads of 32 over 4 KV heads, scores
    # scaled by 48 ** -0.5 (not head_dim's), two sliding layers (window 64) to one global.
    "debugmodel": Gemma3Args(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32, ffn_hidden_dim=768,
                             vocab_size=2048, max_seq_len=4096, query_pre_attn_scalar=48, sliding_window=64,
                             layer_types=gemma3_layer_types(6, pattern=3)),
    "270M": _size(18, dim=640, ffn_hidden_dim=2048, **_SMALL),
    "1B": _size(26, dim=1152, ffn_hidden_dim=6912, **_SMALL),
    "4B": _size(34, dim=2560, ffn_hidden_dim=10240, n_heads=8, n_kv_heads=4, head_dim=256, query_pre_attn_scalar=256,
                **_LARGE),
    "12B": _size(48, dim=3840, ffn_hidden_dim=15360, n_heads=16, n_kv_heads=8, head_dim=256, query_pre_attn_scalar=256,
                 **_LARGE),
    "27B": _size(62, dim=5376, ffn_hidden_dim=21504, n_heads=32, n_kv_heads=16, head_dim=128, query_pre_attn_scalar=168,
                 **_LARGE),
}


def gemma3_args(flavor: str) -> Gemma3Args:
    """A fresh copy of the preset ``flavor``."""
    if flavor not in GEMMA3_PRESETS:
        raise ValueError(f"unknown gemma3 flavor {flavor!r}; valid flavors: {', '.join(GEMMA3_PRESETS)}")
    return copy.deepcopy(GEMMA3_PRESETS[flavor])
