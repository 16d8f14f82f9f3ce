"""DeepSeek V3 sizes: the debugmodel for tests, 16B (DeepSeek-V2-Lite's shapes) and 671B,
with torchtitan's shapes.

671B routes as its checkpoint's config does: each token's 8 experts come from its 4 best groups
of 32 (``n_group=8``, ``topk_group=4``: ``moe.num_groups``, ``moe.top_k_groups``). The
multi-token-prediction layer of the 671B checkpoint (``model.layers.61``) is not built.
The published sizes use the checkpoints' ``rms_norm_eps=1e-6`` (torchtitan: 1e-5).
"""

import copy

from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.deepseek_v3.model import DeepSeekV3Args

# torchtitan's RoPE for every size: YaRN from 4,096 positions, 40 times longer.
_ROPE = dict(max_seq_len=16384, original_seq_len=4096, rope_theta=10000.0, rope_factor=40.0, beta_fast=32.0,
             beta_slow=1.0)
_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)

DEEPSEEK_V3_PRESETS: dict[str, DeepSeekV3Args] = {
    # dim 256, 6 layers (1 dense), 16 heads, 8 routed + 2 shared experts, top-3, small MLA ranks.
    "debugmodel": DeepSeekV3Args(),
    "16B": DeepSeekV3Args(
        dim=2048, n_layers=27, n_dense_layers=1, inter_dim=10944, n_heads=16, n_kv_heads=16, vocab_size=102400,
        norm_eps=1e-6, q_lora_rank=0, mscale=0.70, **_MLA, **_ROPE,
        moe=MoEArgs(num_experts=64, top_k=6, hidden_dim=1408, num_shared_experts=2, score_func="softmax"),
    ),
    "671B": DeepSeekV3Args(
        dim=7168, n_layers=61, n_dense_layers=3, inter_dim=18432, n_heads=128, n_kv_heads=128, vocab_size=129280,
        norm_eps=1e-6, q_lora_rank=1536, mscale=1.0, **_MLA, **_ROPE,
        moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=2048, num_shared_experts=1, score_func="sigmoid",
                    route_norm=True, route_scale=2.5, num_groups=8, top_k_groups=4),
    ),
}


def deepseek_v3_args(flavor: str) -> DeepSeekV3Args:
    """A fresh copy of the preset ``flavor``."""
    if flavor not in DEEPSEEK_V3_PRESETS:
        raise ValueError(f"unknown deepseek_v3 flavor {flavor!r}; valid flavors: {', '.join(DEEPSEEK_V3_PRESETS)}")
    return copy.deepcopy(DEEPSEEK_V3_PRESETS[flavor])
