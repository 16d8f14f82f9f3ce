"""Document masking for packed sequences (``model.mask``, ``model.positions``) and the
attention kernels that honour it (``model.attention``).

A batch of packed windows carries ``position_ids`` [B, S]: each token's position in its
document, 0 where a document starts (titan_lightning/data/dataset.py). From them:

    model.mask = "causal"          every token attends to every earlier token of the window
    model.mask = "block_causal"    ... of its own document only
    model.positions = "global"     RoPE at the token's position in the window
    model.positions = "per_document"  RoPE at its position in its document
    model.sliding_window = W       ... and, in the sliding layers (``model.layer_types``; None: every
                                   layer), only to the keys j with i - W < j <= i (Hugging Face's
                                   ``sliding_window``); composes with either mask

Kernels (``model.attention``, the non-context-parallel ones):

    "sdpa"    F.scaled_dot_product_attention: ``is_causal``, or a dense [B, 1, S, S] boolean
              mask for ``block_causal`` or a window (any device; on GPU the mask rules out the
              flash kernel)
    "flex"    torch's FlexAttention (torch.nn.attention.flex_attention, torch >= 2.5) with a
              BlockMask built once per batch (and one for the sliding layers): blocks of 128 x 128
              that no query of the tile may see are skipped. Compiled on GPU; torch has no FlexAttention backward on CPU, so
              there it only runs forward (tests, evaluation)
    "varlen"  variable-length FlashAttention over the batch flattened to one stream of
              documents (torch.nn.attention.varlen.varlen_attn, seen in torch 2.11 and 2.13; CUDA only;
              a window through its ``window_size``)

A model builds ``Documents`` once per forward (``documents_for``) and hands it to every block
only when the mask, the positions, the kernel or a window need it, so the causal, global, sdpa
default runs exactly the code it ran before. Each attention module knows its own window
(``Attention.window``, set from ``ModelArgs.attention_window``) and passes it to ``attend``; a
window that holds the whole sequence is full attention, computed as such.
"""

import functools
import warnings
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F

from titan_lightning.config.job import KERNEL_ATTENTIONS
from titan_lightning.parallel.context import sdpa_with_sinks, visible


class Documents(NamedTuple):
    """What attention needs of a batch's document boundaries (built once per forward, shared by
    every layer). ``position_ids`` is None only for a causal flex/varlen batch that carries none."""

    position_ids: Optional[torch.Tensor]  # [B, S]: 0 where a document starts
    block_causal: bool
    per_document: bool
    kernel: str = "sdpa"
    mask: Optional[torch.Tensor] = None  # sdpa + block_causal: [B, 1, S, S] bool
    block_mask: Any = None  # flex: a BlockMask (causal, or block-causal)
    cu_seqlens: Optional[torch.Tensor] = None  # varlen: [N + 1] int32 starts of the N documents, flattened
    max_len: int = 0  # varlen: the longest document
    window: Optional[int] = None  # the sliding layers' window, when shorter than the sequence
    sliding: Any = None  # ... their mask: sdpa [B or 1, 1, S, S] bool, flex a BlockMask


def documents_for(args, position_ids: Optional[torch.Tensor], tokens: torch.Tensor,
                  offsets: Optional[tuple[torch.Tensor, int]] = None) -> Optional[Documents]:
    """``Documents`` for model args ``args`` (their ``mask``, ``positions`` and ``attention``) and a
    batch whose first two dims are [B, S] (``tokens``: ids, or a pipeline stage's hidden states);
    None for the causal, global sdpa default. A one-line error when the mask or positions need
    boundaries the batch does not carry. ``offsets``: varlen's (cu_seqlens, longest document) of
    ``position_ids`` already computed (``varlen_offsets`` on the batch's host copy)."""
    block_causal = getattr(args, "mask", "causal") == "block_causal"
    per_document = getattr(args, "positions", "global") == "per_document"
    kernel = getattr(args, "attention", "sdpa")
    B, S = tokens.shape[:2]
    # A context-parallel backend masks by itself (documents and windows).
    window = _sliding_window(args, S) if kernel in KERNEL_ATTENTIONS else None
    kernel = kernel if kernel in KERNEL_ATTENTIONS else "sdpa"
    if not (block_causal or per_document or kernel != "sdpa" or window is not None):
        return None
    if position_ids is None and (block_causal or per_document):
        raise ValueError(f"model.mask={args.mask!r}, model.positions={args.positions!r} need the batch's "
                         f"position_ids (document boundaries); this batch has none")
    if position_ids is not None:
        # Positions are < max_seq_len (validated); the clamp only keeps the RoPE lookup in bounds on the
        # uninitialized buffers a pipeline stage receives once, while torch infers the stage shapes.
        position_ids = position_ids.clamp(0, args.max_seq_len - 1)
    boundaries = position_ids if block_causal else None  # None: one document per row (causal)
    documents = Documents(position_ids, block_causal, per_document, kernel, window=window)
    if kernel == "flex":
        sliding = None if window is None else flex_block_mask(boundaries, B, S, tokens.device, window)
        return documents._replace(block_mask=flex_block_mask(boundaries, B, S, tokens.device), sliding=sliding)
    if kernel == "varlen":
        cu_seqlens, max_len = offsets if offsets is not None else varlen_offsets(boundaries, B, S, tokens.device)
        return documents._replace(cu_seqlens=cu_seqlens, max_len=max_len)
    return documents._replace(mask=block_causal_mask(position_ids) if block_causal else None,
                              sliding=None if window is None else sliding_mask(boundaries, S, window, tokens.device))


def _sliding_window(args, seq_len: int) -> Optional[int]:
    """The window of ``args``' sliding layers when some layer slides and it is shorter than ``seq_len``."""
    window, types = getattr(args, "sliding_window", None), getattr(args, "layer_types", None)
    if window is None or window >= seq_len or (types is not None and "sliding_attention" not in types):
        return None
    return window


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S]: which document of the window each token belongs to (0, 1, ...; the window's first
    token always starts one)."""
    starts = position_ids == 0
    starts[:, 0] = True
    return torch.cumsum(starts, dim=1)


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: query i may attend to key j when j <= i in the same document."""
    ids = document_ids(position_ids)
    at = torch.arange(ids.shape[1], device=ids.device)
    return visible(at, at, None, ids, ids)[:, None]


def sliding_mask(position_ids: Optional[torch.Tensor], S: int, window: int, device) -> torch.Tensor:
    """Query i may attend to key j when i - window < j <= i, in the same document of
    ``position_ids`` ([B, 1, S, S] bool), or of the whole row when None ([1, 1, S, S])."""
    at = torch.arange(S, device=device)
    if position_ids is None:
        return visible(at, at, window)[None, None]
    ids = document_ids(position_ids)
    return visible(at, at, window, ids, ids)[:, None]


def rope_at(rope_cache: torch.Tensor, documents: Optional[Documents], seq_len: int) -> torch.Tensor:
    """The RoPE table for this batch: [S, ...] at window positions, or [B, S, ...] at each token's
    position in its document (``positions = "per_document"``)."""
    if documents is None or not documents.per_document:
        return rope_cache[:seq_len]
    return rope_cache[documents.position_ids]


# -- FlexAttention ---------------------------------------------------------------------------


def flex_block_mask(position_ids: Optional[torch.Tensor], B: int, S: int, device: torch.device,
                    window: Optional[int] = None):
    """The BlockMask of a batch: block-causal over the documents of ``position_ids``, or causal
    (the same for every row: built once per length, window and device) when None; with a
    ``window``, only keys i - window < j <= i."""
    if position_ids is None:
        return _causal_block_mask(S, torch.device(device), window)
    from torch.nn.attention.flex_attention import create_block_mask

    ids = document_ids(position_ids)

    def block_causal(b, h, q, kv):
        mask = (kv <= q) & (ids[b, q] == ids[b, kv])
        return mask if window is None else mask & (q - kv < window)

    if ids.is_cuda:  # a compiled kernel builds it from the [B, S] ids, never as [B, S, S]
        return _compiled_create_block_mask()(block_causal, B, None, S, S, device=device)
    return create_block_mask(block_causal, B, None, S, S, device=device)


@functools.lru_cache(maxsize=1)
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


@functools.lru_cache(maxsize=8)
def _causal_block_mask(S: int, device: torch.device, window: Optional[int] = None):
    from torch.nn.attention.flex_attention import create_block_mask

    if window is None:
        return create_block_mask(lambda b, h, q, kv: kv <= q, None, None, S, S, device=device)
    return create_block_mask(lambda b, h, q, kv: (kv <= q) & (q - kv < window), None, None, S, S, device=device)


def skipped_block_share(block_mask) -> float:
    """The share of the causal tiles a block mask skips (every tile at or below the diagonal
    counts once per batch row): what document masking saves over plain causal attention."""
    q_blocks = block_mask.kv_num_blocks.shape[-1]
    computed = block_mask.kv_num_blocks.sum()
    if block_mask.full_kv_num_blocks is not None:
        computed = computed + block_mask.full_kv_num_blocks.sum()
    rows = block_mask.kv_num_blocks[..., 0].numel()
    causal = rows * q_blocks * (q_blocks + 1) // 2
    return 1.0 - float(computed) / causal


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, block_mask, scale, sinks: Optional[torch.Tensor] = None):
    """FlexAttention over [B, H, S, D] (k, v may have fewer heads: GQA): compiled on GPU, eager
    elsewhere (forward only: torch has no FlexAttention backward on CPU) and in float64 (which
    its Triton kernels do not take: the eager path computes the masked scores densely).
    ``sinks`` [H]: each head's softmax denominator also holds exp(sinks[h]) (gpt-oss), which
    scales the output by sigmoid(lse - sinks[h]) (the log-sum-exp the kernel returns)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    gqa = k.shape[1] != q.shape[1]
    aux = {} if sinks is None else {"return_aux": AuxRequest(lse=True)}
    if q.is_cuda and q.dtype != torch.float64:
        out = _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, **aux)
    else:
        with warnings.catch_warnings():  # "called without torch.compile": the eager path is the CPU one
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, **aux)
    if sinks is None:
        return out
    out, lse = out[0], out[1].lse
    acc = torch.promote_types(lse.dtype, torch.float32)
    return out * torch.sigmoid(lse.to(acc) - sinks.to(acc)[:, None]).to(out.dtype)[..., None]


# -- varlen ----------------------------------------------------------------------------------


def varlen_offsets(position_ids: Optional[torch.Tensor], B: int, S: int, device) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, longest document) of the batch flattened to one stream: every row starts a
    document, and so does every 0 of ``position_ids`` (None: one document per row). One host
    read per batch (the document count and the longest one size the kernel's launch)."""
    if position_ids is None:
        return torch.arange(0, B * S + 1, S, dtype=torch.int32, device=device), S
    starts = position_ids == 0
    starts[:, 0] = True
    offsets = torch.cat([starts.flatten().nonzero().flatten(),
                         torch.tensor([B * S], device=position_ids.device)]).to(torch.int32)
    lengths = offsets.diff()
    return offsets, int(lengths.max())


def _varlen_takes_enable_gqa() -> bool:
    """torch 2.13's varlen_attn refuses fewer K/V heads than query heads unless ``enable_gqa=True``;
    torch 2.11's has no such argument and serves them as they are. Read once, at import: called from
    compiled blocks, where Dynamo traces through (and warns about) a cache such as ``lru_cache``."""
    return _VARLEN_TAKES_ENABLE_GQA


def _read_varlen_signature() -> bool:
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # (a torch without varlen attention: the varlen backend is refused before launch)
        return False
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


_VARLEN_TAKES_ENABLE_GQA = _read_varlen_signature()


def _varlen(q, k, v, documents: Documents, scale, window: Optional[int] = None):
    """varlen FlashAttention over [B, S, H, D] (k, v may have fewer heads: GQA, which the kernel
    serves itself, as flash-attn does: torch 2.11's equals repeated heads bitwise in the forward on an
    H200, in 3% less time, without the repeated K/V saved for the backward); a value head
    narrower than the query's (MLA) is zero-padded to it and the output cut back. ``window``:
    keys i - window < j <= i (the kernel's window_size counts the keys left of the query)."""
    from torch.nn.attention.varlen import varlen_attn

    B, S, H, Dv = v.shape[0], v.shape[1], q.shape[2], v.shape[3]
    if Dv != q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - Dv))
    flat = lambda t: t.reshape(B * S, t.shape[2], t.shape[-1])  # noqa: E731
    cu, n = documents.cu_seqlens, documents.max_len
    left = -1 if window is None else window - 1
    gqa = {"enable_gqa": True} if k.shape[2] != H and _varlen_takes_enable_gqa() else {}  # (torch 2.13 asks)
    y = varlen_attn(flat(q), flat(k), flat(v), cu, cu, n, n, scale=scale, window_size=(left, 0), **gqa)
    return y[..., :Dv].reshape(B, S, H, Dv)


# -- one entry point for every block ---------------------------------------------------------


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Optional[Documents],
           scale: Optional[float] = None, window: Optional[int] = None,
           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal or document-masked attention over [B, S, H, D] (keys and values may have fewer
    heads than the queries: each serves consecutive query heads) -> [B, S, H, D_v], with the
    kernel ``documents`` names (sdpa when None); with a sliding ``window``, query i sees only
    keys i - window < j <= i. ``sinks`` [H] (gpt-oss's attention sinks: a learned logit per head
    in each softmax denominator): sdpa (``sdpa_with_sinks``: one more key) and flex only."""
    B, S = q.shape[:2]
    window = None if window is None or window >= S else window  # (a window over everything: full)
    kernel = "sdpa" if documents is None else documents.kernel
    if kernel == "varlen":
        if sinks is not None:
            raise ValueError("model.attention='varlen' has no attention sinks; use sdpa or flex")
        return _varlen(q, k, v, documents, scale, window)
    if kernel == "flex":
        block_mask = documents.block_mask if window is None else _window_mask(documents, window, B, S, q.device)
        return _flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask, scale,
                     sinks).transpose(1, 2)
    if k.shape[2] != q.shape[2]:
        n_rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if sinks is not None:
        if window is not None:
            mask = _window_mask(documents, window, B, S, q.device)
        elif documents is not None and documents.block_causal:
            mask = documents.mask
        else:
            mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        y = sdpa_with_sinks(q, k, v, mask, sinks, scale)
    elif window is not None:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask(documents, window, B, S, q.device),
                                           scale=scale)
    elif documents is None or not documents.block_causal:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=documents.mask, scale=scale)
    return y.transpose(1, 2)


def _window_mask(documents: Optional[Documents], window: int, B: int, S: int, device):
    """The sliding mask of ``documents``' kernel (sdpa: dense, flex: a BlockMask): the one built
    for the batch, or (a window other than the model's) built here."""
    if documents is not None and documents.window == window:
        return documents.sliding
    boundaries = documents.position_ids if documents is not None and documents.block_causal else None
    if documents is not None and documents.kernel == "flex":
        return flex_block_mask(boundaries, B, S, device, window)
    return sliding_mask(boundaries, S, window, device)
