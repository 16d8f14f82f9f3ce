"""Qwen 3 sizes: the debug models for tests, and the published shapes of the dense models
(0.6B ... 32B) and the mixture-of-experts models (30B-A3B, 235B-A22B), as in their Hugging
Face configs: vocabulary 151,936, head_dim 128, QK-norm, GQA, rope_theta 1e6, 40,960 positions.

Embeddings and output are never tied. Hugging Face ties them for 0.6B, 1.7B and 4B; we do
not, so those have ``vocab_size * dim`` more parameters here than on their model cards
(0.6B: 0.75B; 1.7B: 2.03B; 4B: 4.41B). Load such a checkpoint with
``Qwen3StateDictAdapter(args, tie_word_embeddings=True)``: the output starts as a copy of
the embeddings.

The MoE models route each token to 8 of 128 experts by softmax scores, renormalized over
the 8 (Hugging Face ``norm_topk_prob``), with no shared experts.
"""

import copy

from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.qwen3.model import Qwen3Args

_QWEN3 = dict(vocab_size=151936, head_dim=128, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960)


def _moe(*, num_experts: int, top_k: int, hidden_dim: int) -> MoEArgs:
    return MoEArgs(
        num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, num_shared_experts=0,
        score_func="softmax", route_norm=True, load_balance_coeff=1e-3,
    )


QWEN3_PRESETS: dict[str, Qwen3Args] = {
    # torchtitan's debugmodel shape (dim 256, 8 layers, 16 heads, 8 KV heads, vocab 2048), with
    # head_dim 64 and a 768-wide SwiGLU to stay quick on CPU; head_dim != dim / n_heads on purpose.
    "debugmodel": Qwen3Args(
        dim=256, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=64, ffn_hidden_dim=768, vocab_size=2048,
        max_seq_len=4096,
    ),
    "debugmodel_moe": Qwen3Args(
        dim=256, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=64, ffn_hidden_dim=768, vocab_size=2048,
        max_seq_len=4096, moe=_moe(num_experts=64, top_k=8, hidden_dim=64),
    ),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=3072, **_QWEN3),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=6144, **_QWEN3),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=9728, **_QWEN3),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=12288, **_QWEN3),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden_dim=17408, **_QWEN3),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden_dim=25600, **_QWEN3),
    # ffn_hidden_dim is Hugging Face's (unused) intermediate_size: every block is a MoE.
    "30B-A3B": Qwen3Args(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden_dim=6144,
        moe=_moe(num_experts=128, top_k=8, hidden_dim=768), **_QWEN3,
    ),
    "235B-A22B": Qwen3Args(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_hidden_dim=12288,
        moe=_moe(num_experts=128, top_k=8, hidden_dim=1536), **_QWEN3,
    ),
}


def qwen3_args(flavor: str) -> Qwen3Args:
    """A fresh copy of the preset ``flavor``."""
    if flavor not in QWEN3_PRESETS:
        raise ValueError(f"unknown qwen3 flavor {flavor!r}; valid flavors: {', '.join(QWEN3_PRESETS)}")
    return copy.deepcopy(QWEN3_PRESETS[flavor])
