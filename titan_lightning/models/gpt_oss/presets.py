"""gpt-oss sizes: the debug model for tests, and the published shapes of gpt-oss-20b and
gpt-oss-120b as in their Hugging Face configs: dim 2880, 64 query heads and 8 KV heads of 64
features, sliding-window (128) and full layers alternating, YaRN (factor 32 over 4096 positions,
rope_theta 150000) to 131072 positions, vocabulary 201,088, experts of width 2880, top 4.

The presets keep torchtitan's auxiliary-loss-free expert bias (``load_balance_coeff``) for training
from scratch; a model read from a Hugging Face folder trains without it (gpt-oss's checkpoint has
no place for it; models/gpt_oss/model.py).
"""

import copy

from titan_lightning.models.gpt_oss.model import GptOssArgs, GptOssYarn, alternating, gpt_oss_moe


def _published(*, n_layers: int, num_experts: int) -> GptOssArgs:
    return GptOssArgs(
        vocab_size=201088, dim=2880, n_layers=n_layers, n_heads=64, n_kv_heads=8, head_dim=64, norm_eps=1e-5,
        rope_theta=150000.0, rope_scaling=GptOssYarn(factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                                     original_max_position_embeddings=4096, truncate=False),
        max_seq_len=131072, moe=gpt_oss_moe(num_experts=num_experts, top_k=4, hidden_dim=2880),
        sliding_window=128, layer_types=alternating(n_layers),
    )


GPT_OSS_PRESETS: dict[str, GptOssArgs] = {
    # dim 256, 4 layers (sliding, full, sliding, full: window 32), 8 heads of 64 over 2 KV heads,
    # 8 experts of width 256, top 2, YaRN factor 4 over 1024 positions; vocab 2048.
    "debugmodel": GptOssArgs(),
    "20B": _published(n_layers=24, num_experts=32),
    "120B": _published(n_layers=36, num_experts=128),
}


def gpt_oss_args(flavor: str) -> GptOssArgs:
    """A fresh copy of the preset ``flavor``."""
    if flavor not in GPT_OSS_PRESETS:
        raise ValueError(f"unknown gpt_oss flavor {flavor!r}; valid flavors: {', '.join(GPT_OSS_PRESETS)}")
    return copy.deepcopy(GPT_OSS_PRESETS[flavor])
