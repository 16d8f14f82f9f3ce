"""The keys and values an attention layer has seen, so decoding feeds one new token per step
(titan_lightning/generate.py) instead of the whole sequence again.

``Attention`` takes one through its ``kv_cache`` slot (None in training: the code it ran before).
With a cache, the module's input is the tokens that follow the cached ones: RoPE turns them at
their positions ``start, start + 1, ...``, their keys and values (rotated) join the cache, and the
queries attend to every cached key they may see: not later, within the layer's sliding window
(``visible``, the one rule the kernels share), with the attention sinks of gpt-oss as one more key
(``sdpa_with_sinks``). So the same cache serves the dense, MoE, sliding-window and sink families,
whatever their RoPE table (Llama 3.1 scaling, YaRN, LongRoPE, Gemma's two tables: the table the
block hands its attention is indexed here, not rebuilt).

A sliding layer keeps every key too (its window masks the old ones): one layout for every layer,
and ``rewind`` can return to any earlier position (chat keeps the conversation's prefix).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from titan_lightning.parallel.context import sdpa_with_sinks, visible


class KVCache:
    """One layer's cache: keys and values [B, capacity, H_kv, D] of the tokens before ``start``.
    It grows as needed (doubling, at most ``max_len``: the model's RoPE table)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.start = 0
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def rewind(self, start: int) -> None:
        """Forget the tokens from ``start`` on (their keys are overwritten by the next ones)."""
        if not 0 <= start <= self.start:
            raise ValueError(f"cannot rewind a cache of {self.start} tokens to {start}")
        self.start = start

    def rope(self, rope_cache: torch.Tensor, seq_len: int) -> torch.Tensor:
        """The rows of ``rope_cache`` ([max_seq_len, ...]) for the next ``seq_len`` tokens."""
        end = self.start + seq_len
        if end > self.max_len:
            raise ValueError(f"{end} tokens do not fit the model's {self.max_len} positions (model.max_seq_len)")
        return rope_cache[self.start:end]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
               window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of the new tokens' queries [B, S, H, D] over the cached keys and their own
        (k, v [B, S, H_kv, D], rotated): [B, S, H, D_v]. Advances ``start`` by S."""
        B, S = q.shape[:2]
        end = self.start + S
        self._store(k, v, end)
        keys, values = self.k[:, :end], self.v[:, :end]
        if keys.shape[2] != q.shape[2]:  # grouped-query: each key/value head serves consecutive query heads
            n_rep = q.shape[2] // keys.shape[2]
            keys, values = keys.repeat_interleave(n_rep, dim=2), values.repeat_interleave(n_rep, dim=2)
        positions = torch.arange(end, device=q.device)
        mask = visible(positions[self.start:], positions, window)  # [S, end]
        q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        if sinks is not None:
            y = sdpa_with_sinks(q, keys, values, mask, sinks, scale)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        self.start = end
        return y.transpose(1, 2)

    def _store(self, k: torch.Tensor, v: torch.Tensor, end: int) -> None:
        if self.k is None or self.k.shape[1] < end:
            capacity = min(self.max_len, max(end, 2 * (self.k.shape[1] if self.k is not None else 32)))
            grown_k = k.new_empty(k.shape[0], capacity, *k.shape[2:])
            grown_v = v.new_empty(v.shape[0], capacity, *v.shape[2:])
            if self.k is not None:
                grown_k[:, :self.start], grown_v[:, :self.start] = self.k[:, :self.start], self.v[:, :self.start]
            self.k, self.v = grown_k, grown_v
        self.k[:, self.start:end] = k
        self.v[:, self.start:end] = v


def cached_attentions(model: nn.Module) -> Optional[list[nn.Module]]:
    """The attention modules of ``model`` that take a ``kv_cache``, or None when a block's attention
    does not (DeepSeek V3's latent attention: decoding then recomputes the whole sequence)."""
    layers = getattr(model, "layers", None)
    attentions = [getattr(block, "attention", None) for block in (layers.values() if layers is not None else ())]
    if not attentions or not all(hasattr(a, "kv_cache") for a in attentions):
        return None
    return attentions
