"""OLMo 2 decoders, with torchtitan's submodule names where they mean the same.

Llama's attention (grouped-query, RoPE) and SwiGLU, in a block with no pre-norms: each sublayer's
output is normalized before it joins the residual stream,

    h = x + post_attention_norm(attention(x));  out = h + post_ffn_norm(feed_forward(h))

and QK-norm spans the whole q projection (n_heads * head_dim features) and the whole k projection,
before the heads are split and RoPE turns them (``ProjectionNorm``). Under tensor parallelism
each rank holds its heads' features of those projections, so the norm's mean square is a sum
over the TP ranks (``colwise_norm`` in parallel/tensor_styles.py).
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_lightning.models.common import Attention, FeedForward, RMSNorm
from titan_lightning.models.common.args import DecoderArgs
from titan_lightning.models.common.decoder import Decoder
from titan_lightning.models.common.masking import Documents
from titan_lightning.models.olmo2.parallelize import TP_PLAN
from titan_lightning.parallel.collectives import all_reduce_autograd


@dataclass(kw_only=True)
class Olmo2Args(DecoderArgs):
    """OLMo 2 architecture. The defaults are the debugmodel; presets.py has the published sizes."""

    rope_theta: float = 500000.0


class ProjectionNorm(nn.Module):
    """RMSNorm over all the heads of a projection at once, given as [B, S, H, head_dim] (the
    attention's view of it), in float32. A weight sharded over the TP ranks (``colwise_norm``: each
    holds its heads' features) makes the mean square a sum over them (autograd all-reduce)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, flat = self.weight, x.flatten(-2).float()
        squares, width = flat.pow(2).sum(-1, keepdim=True), flat.shape[-1]
        if isinstance(weight, DTensor):
            mesh = weight.device_mesh
            squares, width = all_reduce_autograd(squares, mesh.get_group()), width * mesh.size()
            weight = weight.to_local()
        normed = flat * torch.rsqrt(squares / width + self.eps)
        return (normed * weight.float()).type_as(x).view(x.shape)


class Olmo2RMSNorm(RMSNorm):
    """RMSNorm with the weight applied in float32 before the cast back (Hugging Face's Olmo2RMSNorm;
    the shared RMSNorm casts first, as Llama's does): the same in fp32, one rounding less in bf16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.weight.float()).type_as(x)


class Olmo2Block(nn.Module):
    """``attention`` and ``feed_forward``, each followed by its norm before the residual add (no
    pre-norms). Takes and returns the residual stream as the shared ``Block`` does."""

    def __init__(self, args: Olmo2Args):
        super().__init__()
        a = args
        self.attention = Attention(a.dim, a.n_heads, a.n_kv_heads, a.attention, head_dim=a.head_dim)
        self.attention.q_norm = ProjectionNorm(a.n_heads * a.head_dim, a.norm_eps)
        self.attention.k_norm = ProjectionNorm(a.n_kv_heads * a.head_dim, a.norm_eps)
        self.post_attention_norm = Olmo2RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a.dim, a.ffn_hidden_dim)
        self.post_ffn_norm = Olmo2RMSNorm(a.dim, a.norm_eps)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, *,
                documents: Optional[Documents] = None) -> torch.Tensor:
        h = x + self.post_attention_norm(self.attention(x, rope_cache, documents=documents))
        return h + self.post_ffn_norm(self.feed_forward(h))


class Transformer(Decoder):
    """OLMo 2: token embeddings, post-norm GQA blocks with QK-norm over whole projections and
    SwiGLU, final norm, untied output (models/common/decoder.py has the skeleton)."""

    args_class, plan = Olmo2Args, TP_PLAN

    def __init__(self, args: Olmo2Args):
        super().__init__(args)
        self.norm = Olmo2RMSNorm(args.dim, args.norm_eps)

    def build_block(self, layer_id: int) -> Olmo2Block:
        return Olmo2Block(self.args)
