"""Mistral and Mixtral decoders, with torchtitan's submodule names.

Mistral is Llama's block (pre-norm grouped-query attention, RoPE, SwiGLU) with ``head_dim`` a field
of its own (Mistral Nemo: 32 heads of 128 on dim 5120). Mixtral replaces each SwiGLU with a mixture
of 8 SwiGLU experts: a softmax router picks each token's top 2, their weights renormalized over
the 2, no shared expert (models/common/moe.py). Sliding-window attention (Mistral 7B v0.1's 4096)
is ``model.sliding_window`` on every layer (models/common/hf_config.py ``sliding_window_fields``).

Load balancing: Hugging Face Mixtral trains with an auxiliary loss (``router_aux_loss_coef``); the
MoE here has the auxiliary-loss-free expert bias instead (``moe.load_balance_coeff``), which
Mixtral's checkpoint has no place for, so a model read from a config.json trains without either.
"""

from dataclasses import dataclass
from typing import Optional

from titan_lightning.models.common.args import DecoderArgs
from titan_lightning.models.common.decoder import Decoder
from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.mistral.parallelize import TP_PLAN


@dataclass(kw_only=True)
class MistralArgs(DecoderArgs):
    """Mistral / Mixtral architecture. The defaults are the dense debugmodel; presets.py has the
    published sizes."""

    norm_eps: float = 1e-5
    # None: Mistral (dense); otherwise every block is a mixture of experts (Mixtral).
    moe: Optional[MoEArgs] = None


class Transformer(Decoder):
    """Mistral / Mixtral: token embeddings, pre-norm GQA blocks with SwiGLU or MoE, final norm,
    untied output (models/common/decoder.py has the skeleton)."""

    args_class, plan = MistralArgs, TP_PLAN
