"""Qwen 3 decoder (dense and mixture-of-experts), with torchtitan's submodule names.

Per block: pre-norm grouped-query attention with QK-norm (an RMSNorm over each head's
features of q and k, before RoPE), then either a dense SwiGLU (``feed_forward``) or a
``moe`` of routed SwiGLU experts (Qwen3-MoE: softmax router, top-k renormalized, no shared
experts). Unlike Llama, ``head_dim`` is its own field (128 in every published size), so
``n_heads * head_dim`` need not equal ``dim``.

Load balancing: Hugging Face Qwen3-MoE trains with an auxiliary loss; here the MoE uses
the auxiliary-loss-free expert bias of models/common/moe.py (``moe.load_balance_coeff``).
"""

from dataclasses import dataclass
from typing import Optional

from titan_lightning.models.common import Attention
from titan_lightning.models.common.args import DecoderArgs
from titan_lightning.models.common.decoder import Decoder
from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.qwen3.parallelize import TP_PLAN


@dataclass(kw_only=True)
class Qwen3Args(DecoderArgs):
    """Qwen 3 architecture. The defaults are the dense debugmodel; presets.py has the published sizes."""

    n_layers: int = 8
    head_dim: int = 64
    # RMSNorm of q and k per head (every published Qwen 3 has it).
    qk_norm: bool = True
    # None: dense; otherwise every block is a mixture of experts.
    moe: Optional[MoEArgs] = None


class Transformer(Decoder):
    """Qwen 3: token embeddings, pre-norm GQA (QK-norm) blocks with SwiGLU or MoE, final norm,
    untied output (models/common/decoder.py has the skeleton)."""

    args_class, plan = Qwen3Args, TP_PLAN

    def build_attention(self, layer_id: int) -> Attention:
        a = self.args
        return Attention(a.dim, a.n_heads, a.n_kv_heads, a.attention, head_dim=a.head_dim,
                         qk_norm_eps=a.norm_eps if a.qk_norm else None)

    @classmethod
    def count_parameters(cls, args: Qwen3Args, *, active: bool = False) -> int:
        """Embeddings and output are not tied; ``active``: a token's ``top_k`` routed experts
        instead of all of them."""
        d, q, kv = args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        attention = 2 * d * q + 2 * d * kv + (2 * args.head_dim if args.qk_norm else 0)
        if args.moe is None:
            ffn = 3 * d * args.ffn_hidden_dim
        else:
            m = args.moe
            routed = m.top_k if active else m.num_experts
            ffn = d * m.num_experts + 3 * d * m.hidden_dim * (routed + m.num_shared_experts)
        return 2 * args.vocab_size * d + args.n_layers * (attention + ffn + 2 * d) + d
