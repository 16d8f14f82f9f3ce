"""Qwen 2 / Qwen 2.5 decoder, with torchtitan's submodule names.

Llama's block (pre-norm grouped-query attention, RoPE, SwiGLU) with a bias on the q, k and v
projections (none on the output projection, none in the SwiGLU). ``head_dim`` is its own field
as in Qwen 3 (``dim // n_heads`` in every released size). Sliding-window attention is off in every
released config (``use_sliding_window: false``); a config that turns it on slides the layers from
``max_window_layers`` on (models/common/hf_config.py ``sliding_window_fields``).
"""

from dataclasses import dataclass

from titan_lightning.models.common import Attention
from titan_lightning.models.common.args import DecoderArgs
from titan_lightning.models.common.decoder import Decoder
from titan_lightning.models.qwen2.parallelize import TP_PLAN


@dataclass(kw_only=True)
class Qwen2Args(DecoderArgs):
    """Qwen 2 architecture. The defaults are the debugmodel; presets.py has the published sizes."""

    # A bias on wq, wk and wv (every released Qwen 2 has them).
    qkv_bias: bool = True


class Transformer(Decoder):
    """Qwen 2: token embeddings, pre-norm GQA blocks with q/k/v biases and SwiGLU, final norm,
    untied output (models/common/decoder.py has the skeleton)."""

    args_class, plan = Qwen2Args, TP_PLAN

    def build_attention(self, layer_id: int) -> Attention:
        a = self.args
        return Attention(a.dim, a.n_heads, a.n_kv_heads, a.attention, head_dim=a.head_dim, qkv_bias=a.qkv_bias)
