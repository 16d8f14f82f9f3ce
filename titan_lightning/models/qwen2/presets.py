"""Qwen 2.5 sizes: the debugmodel for tests, and the published shapes of the dense base models
(0.5B ... 72B) as in their Hugging Face configs: q/k/v biases, GQA, head_dim dim / n_heads (128,
64 for 0.5B), rope_theta 1e6; vocabulary 151,936 up to 3B, 152,064 from 7B.

Embeddings and output are never tied. Hugging Face ties them for 0.5B, 1.5B and 3B; we do not,
so those have ``vocab_size * dim`` more parameters here than on their model cards. A folder of
such a checkpoint loads with ``Qwen2StateDictAdapter(args, tie_word_embeddings=True)`` (as
``recipes.hf:pretrained`` does from its config.json): the output starts as a copy of the embeddings.
"""

import copy

from titan_lightning.models.qwen2.model import Qwen2Args

_SMALL = dict(vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6)
_LARGE = dict(vocab_size=152064, rope_theta=1000000.0, max_seq_len=131072)

QWEN2_PRESETS: dict[str, Qwen2Args] = {
    # torchtitan's debugmodel shape (dim 256, 16 heads, vocab 2048) with 8 KV heads, 6 layers.
    "debugmodel": Qwen2Args(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=16, ffn_hidden_dim=768,
                            vocab_size=2048, max_seq_len=4096),
    "0.5B": Qwen2Args(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, ffn_hidden_dim=4864,
                      max_seq_len=32768, **_SMALL),
    "1.5B": Qwen2Args(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128, ffn_hidden_dim=8960,
                      max_seq_len=131072, **_SMALL),
    "3B": Qwen2Args(dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, head_dim=128, ffn_hidden_dim=11008,
                    max_seq_len=32768, **_SMALL),
    "7B": Qwen2Args(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128, ffn_hidden_dim=18944,
                    norm_eps=1e-6, **_LARGE),
    "14B": Qwen2Args(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim=128, ffn_hidden_dim=13824,
                     norm_eps=1e-5, **_LARGE),
    "32B": Qwen2Args(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, head_dim=128, ffn_hidden_dim=27648,
                     norm_eps=1e-5, **_LARGE),
    "72B": Qwen2Args(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, ffn_hidden_dim=29568,
                     norm_eps=1e-5, **_LARGE),
}


def qwen2_args(flavor: str) -> Qwen2Args:
    """A fresh copy of the preset ``flavor``."""
    if flavor not in QWEN2_PRESETS:
        raise ValueError(f"unknown qwen2 flavor {flavor!r}; valid flavors: {', '.join(QWEN2_PRESETS)}")
    return copy.deepcopy(QWEN2_PRESETS[flavor])
