"""Document masking for packed sequences (``model.mask``, ``model.positions``).

A batch of packed windows carries ``position_ids`` [B, S]: each token's position in its
document, 0 where a document starts (titan_lightning/data/dataset.py). From them:

    model.mask = "causal"          every token attends to every earlier token of the window
    model.mask = "block_causal"    ... of its own document only
    model.positions = "global"     RoPE at the token's position in the window
    model.positions = "per_document"  RoPE at its position in its document

A model hands ``Documents`` to its blocks only when one of the two asks for it, so the causal,
global default runs exactly the code it ran before.
"""

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F



class Documents(NamedTuple):
    """What attention needs of a batch's document boundaries (built once per forward, shared by
    every layer)."""

    position_ids: torch.Tensor  # [B, S]: 0 where a document starts
    block_causal: bool
    per_document: bool
    mask: Optional[torch.Tensor] = None  # [B, 1, S, S] block-causal mask, when block_causal


def documents_for(args, position_ids: Optional[torch.Tensor]) -> Optional[Documents]:
    """``Documents`` for model args ``args`` (their ``mask`` and ``positions``), or None when both
    are the defaults; a one-line error when they need boundaries the batch does not carry."""
    block_causal = getattr(args, "mask", "causal") == "block_causal"
    per_document = getattr(args, "positions", "global") == "per_document"
    if not (block_causal or per_document):
        return None
    if position_ids is None:
        raise ValueError(f"model.mask={args.mask!r}, model.positions={args.positions!r} need the batch's "
                         f"position_ids (document boundaries); this batch has none")
    # Positions are < max_seq_len (validated); the clamp only keeps the RoPE lookup in bounds on the
    # uninitialized buffers a pipeline stage receives once, while torch infers the stage shapes.
    position_ids = position_ids.clamp(0, args.max_seq_len - 1)
    return Documents(position_ids, block_causal, per_document,
                     block_causal_mask(position_ids) if block_causal else None)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S]: which document of the window each token belongs to (0, 1, ...)."""
    return torch.cumsum(position_ids == 0, dim=1)


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: query i may attend to key j when j <= i in the same document."""
    ids = document_ids(position_ids)
    S = ids.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=ids.device).tril()
    return (causal & (ids[:, :, None] == ids[:, None, :]))[:, None]


def rope_at(rope_cache: torch.Tensor, documents: Optional[Documents], seq_len: int) -> torch.Tensor:
    """The RoPE table for this batch: [S, ...] at window positions, or [B, S, ...] at each token's
    position in its document (``positions = "per_document"``)."""
    if documents is None or not documents.per_document:
        return rope_cache[:seq_len]
    return rope_cache[documents.position_ids]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Optional[Documents],
              scale: Optional[float] = None) -> torch.Tensor:
    """SDPA over [B, H, S, D]: causal, or block-causal with ``documents`` (a dense mask)."""
    if documents is None or not documents.block_causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.mask, scale=scale)
