"""Qwen 2 / Qwen 2.5 decoder, with torchtitan's submodule names.

Llama's block (pre-norm grouped-query attention, RoPE, SwiGLU) with a bias on the q, k and v
projections (none on the output projection, none in the SwiGLU). ``head_dim`` is its own field
as in Qwen 3 (``dim // n_heads`` in every released size). Sliding-window attention is off in every
released config (``use_sliding_window: false``); a config that turns it on slides the layers from
``max_window_layers`` on (models/common/hf_config.py ``sliding_window_fields``).
"""

from dataclasses import dataclass

import torch

from titan_lightning.config.job import ModelArgs
from titan_lightning.models.common import Attention, FeedForward, precompute_rope_cache
from titan_lightning.models.common.decoder import Block, Decoder
from titan_lightning.models.qwen2.parallelize import TP_PLAN


@dataclass(kw_only=True)
class Qwen2Args(ModelArgs):
    """Qwen 2 architecture. The defaults are the debugmodel; presets.py has the published sizes."""

    n_kv_heads: int = 8
    dim: int = 256
    n_layers: int = 6
    head_dim: int = 16
    # Width of the SwiGLU (Hugging Face ``intermediate_size``).
    ffn_hidden_dim: int = 768
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 4096
    # A bias on wq, wk and wv (every released Qwen 2 has them).
    qkv_bias: bool = True
    # std of wo/w2/w3: 0.02 / sqrt(2 * (layer_id + 1)) if True, else 0.02 / sqrt(2 * n_layers).
    depth_init: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_positive_ints("dim", "n_layers", "head_dim", "ffn_hidden_dim", "max_seq_len")
        self.require_positive("norm_eps", "rope_theta")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even (RoPE rotates pairs of features)")


class Transformer(Decoder):
    """Qwen 2: token embeddings, pre-norm GQA blocks with q/k/v biases and SwiGLU, final norm,
    untied output (models/common/decoder.py has the skeleton)."""

    args_class = Qwen2Args

    def build_block(self, layer_id: int) -> Block:
        a = self.args
        attention = Attention(a.dim, a.n_heads, a.n_kv_heads, a.attention, head_dim=a.head_dim, qkv_bias=a.qkv_bias)
        return Block(a.dim, a.norm_eps, attention, FeedForward(a.dim, a.ffn_hidden_dim))

    def build_rope_cache(self) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta)

    @classmethod
    def tp_plan(cls, args: Qwen2Args) -> dict[str, str]:
        return dict(TP_PLAN)
