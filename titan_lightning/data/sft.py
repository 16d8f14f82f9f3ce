"""SFT data: the conversations of a masked shard set as training samples (``data.sft``).

A shard set written by ``titan-lightning prepare --chat`` holds one conversation per document
(its end in ``.docs``) and a per-token loss mask (``.mask``: 1 where the token is a supervised
target; data/shards.py). A sample is a window of ``seq_len + 1`` tokens holding whole
conversations (``data.sft_packing``):

    "packed"   as many consecutive conversations as fit, in corpus order (next-fit), so a
               conversation never crosses a window; train with ``model.mask="block_causal"``
               and ``model.positions="per_document"`` so that they stay apart
    "best_fit" whole conversations too, but packed best-fit decreasing within each group of
               ``BEST_FIT_GROUP`` consecutive conversations: far less padding than next-fit
               (benchmarks/sft_data.py measures it); the same mask and positions
    "padded"   one conversation; ``TrimPadding`` cuts each batch to its longest conversation

and the rest of the window is padding (the tokenizer's EOS). The sample is::

    input_ids     window[:-1]
    labels        window[1:], IGNORE_INDEX where the target is not supervised: mask 0, the first
                  token of a conversation (nothing before it in its document predicts it), padding
    position_ids  each input's position in its own conversation (padding: a document of its own)

so every supervised token is a label exactly once per epoch. A conversation longer than the window
(``prepare`` truncates or drops those; one written otherwise) is split into pieces of the window's
length, each a document of its own, with one warning.

The window table (which conversations each window holds) is computed once, from ``.docs``, with
NumPy; the windows are then shuffled, sharded over data-parallel ranks and resumed as pretraining
windows are (``TrainStream``, ``ValWindows``, ``epoch_order``: a shard set's order is a
``FeistelPermutation`` of the windows).
"""

import bisect
import math
import warnings
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from titan_lightning.config.data import SFT_PACKINGS
from titan_lightning.data.shards import TokenSpan
from titan_lightning.models.common.loss import IGNORE_INDEX


def split_long(ends: np.ndarray, window: int) -> tuple[np.ndarray, int]:
    """Document ``ends`` (ascending offsets) with every document longer than ``window`` cut into
    pieces of ``window`` tokens (the last one shorter), and empty documents dropped; and how many
    documents were cut."""
    ends = np.asarray(ends, dtype=np.int64)
    ends = ends[np.diff(ends, prepend=0) > 0]
    begins = np.concatenate([[0], ends[:-1]])
    pieces = -(-(ends - begins) // window)
    long = int(np.count_nonzero(pieces > 1))
    if not long:
        return ends, 0
    within = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    return np.minimum(np.repeat(begins, pieces) + window * (within + 1), np.repeat(ends, pieces)), long


def pack(ends: np.ndarray, window: int) -> np.ndarray:
    """Next-fit packing of documents (``ends``: ascending offsets, none longer than ``window``) in
    order: ``first[k]`` is the index of window ``k``'s first document, ``first[-1] == len(ends)``."""
    begins = np.concatenate([[0], ends[:-1]])
    following = np.searchsorted(ends, begins + window, side="right").tolist()  # first that no longer fits
    first, i = [0], 0
    while i < len(ends):
        i = following[i]
        first.append(i)
    return np.asarray(first, dtype=np.int64)


# Conversations packed together by "best_fit": consecutive groups of this many (a window never
# mixes two groups, so the table is computed group by group and a corpus's order still shows).
BEST_FIT_GROUP = 4096


def best_fit(ends: np.ndarray, window: int, group: int = BEST_FIT_GROUP) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing packing of documents (``ends``: ascending offsets, none longer than
    ``window``) within each ``group`` of consecutive ones: each document, longest first, goes to
    the open window it fills most tightly, else to a new one. Returns ``(members, first)``: window
    ``k`` holds documents ``members[first[k]:first[k + 1]]`` (in corpus order), windows ordered by
    their first document."""
    lengths = np.diff(ends, prepend=0).tolist()
    windows: list[list[int]] = []
    for g in range(0, len(lengths), group):
        free: list[tuple[int, int]] = []  # (room left, window id), sorted
        opened: list[list[int]] = []
        for i in sorted(range(g, min(g + group, len(lengths))), key=lambda d: (-lengths[d], d)):
            slot = bisect.bisect_left(free, (lengths[i], -1))
            if slot == len(free):
                opened.append([i])
                bisect.insort(free, (window - lengths[i], len(opened) - 1))
            else:
                room, w = free.pop(slot)
                opened[w].append(i)
                bisect.insort(free, (room - lengths[i], w))
        windows += sorted((sorted(w) for w in opened), key=lambda w: w[0])
    members = np.asarray([d for w in windows for d in w], dtype=np.int64)
    first = np.concatenate([[0], np.cumsum([len(w) for w in windows])]).astype(np.int64)
    return members, first


class ConversationWindows(Dataset):
    """The SFT samples of a masked shard span (see the module docstring), in corpus order."""

    def __init__(self, tokens: TokenSpan, seq_len: int, pad_id: int, packing: str = "packed") -> None:
        if packing not in SFT_PACKINGS:
            raise ValueError(f"data.sft_packing={packing!r} is not one of {', '.join(SFT_PACKINGS)}")
        self.tokens, self.seq_len, self.pad_id, self.packing = tokens, seq_len, pad_id, packing
        shards = tokens.shards
        ends = shards.document_ends(tokens.start, tokens.stop) - tokens.start
        self.ends, long = split_long(ends, seq_len + 1)
        if long:
            warnings.warn(f"{long} conversation(s) of {shards.folder} are longer than training.seq_len + 1 = "
                          f"{seq_len + 1} tokens: each is split into pieces trained as separate conversations; "
                          f"prepare with that max length (truncate or drop) to avoid it", stacklevel=2)
        # Window k holds documents members[first[k]:first[k + 1]] (next-fit and padded: in order).
        self.members = np.arange(len(self.ends), dtype=np.int64)
        if packing == "best_fit":
            self.members, self.first = best_fit(self.ends, seq_len + 1)
        else:
            self.first = pack(self.ends, seq_len + 1) if packing == "packed" else np.arange(len(self.ends) + 1)

    def __len__(self) -> int:
        return len(self.first) - 1

    def packing_line(self) -> str:
        """How full the windows are: conversations, windows, and the share of window tokens that are
        conversation tokens (the rest is padding, trimmed per batch where a whole column is padding)."""
        conversations, tokens = len(self.ends), int(self.ends[-1]) if len(self.ends) else 0
        capacity = max(1, len(self) * (self.seq_len + 1))
        return (f"{conversations:,} conversation(s) in {len(self):,} window(s) of {self.seq_len + 1:,} tokens "
                f"(data.sft_packing {self.packing}): {100 * tokens / capacity:.1f}% of window tokens are "
                f"conversation tokens, {100 - 100 * tokens / capacity:.1f}% padding")

    def documents(self, index: int) -> tuple[int, np.ndarray]:
        """Window ``index``'s first token offset in the span and its documents' ends (in the span):
        for the packings whose windows hold consecutive documents ("packed", "padded")."""
        if self.packing == "best_fit":
            raise ValueError("documents(): a best_fit window's documents are not consecutive; use spans()")
        a, b = int(self.first[index]), int(self.first[index + 1])
        return (int(self.ends[a - 1]) if a else 0), self.ends[a:b]

    def spans(self, index: int) -> list[tuple[int, int]]:
        """Window ``index``'s documents as (begin, end) token offsets in the span, in window order."""
        docs = self.members[self.first[index]:self.first[index + 1]]
        return [(int(self.ends[d - 1]) if d else 0, int(self.ends[d])) for d in docs.tolist()]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        spans, size = self.spans(index), self.seq_len + 1
        lengths = [e - b for b, e in spans]
        used = sum(lengths)
        window = np.full(size, self.pad_id, dtype=np.int64)
        supervised = np.zeros(size, dtype=bool)
        offset, base = 0, self.tokens.start
        for b, e in _runs(spans):  # one read per run of consecutive documents
            window[offset:offset + e - b] = self.tokens[b:e]
            supervised[offset:offset + e - b] = self.tokens.shards.read_mask(base + b, base + e) != 0
            offset += e - b
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1], [used] if used < size else []]).astype(np.int64)
        positions = np.arange(size) - starts[np.searchsorted(starts, np.arange(size), side="right") - 1]
        labels = np.where(supervised[1:] & (positions[1:] != 0), window[1:], IGNORE_INDEX)
        return {"input_ids": torch.from_numpy(window[:-1]), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(positions[:-1])}


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` with each span that starts where the previous one ends merged into it."""
    runs = [list(spans[0])]
    for b, e in spans[1:]:
        if b == runs[-1][1]:
            runs[-1][1] = e
        else:
            runs.append([b, e])
    return [(b, e) for b, e in runs]


class TrimPadding:
    """The collate of padded SFT batches: stacks the samples, then cuts the batch to its longest
    conversation rounded up to ``multiple`` (never past ``seq_len``). A row's padding starts where
    its ``position_ids`` return to 0; what is cut is padding only, so the loss and gradients are
    those of the whole rows.

    ``multiple`` (``sequence_multiple``): 8, and every length context and sequence parallelism
    split must divide; under pipeline parallelism ``seq_len`` (torch's schedules fix the stage
    shapes at the first batch)."""

    def __init__(self, multiple: int) -> None:
        self.multiple = multiple

    def __call__(self, samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = default_collate(samples)
        positions = batch["position_ids"]
        width = positions.shape[1]
        index = torch.arange(width)
        padding_starts = torch.where(positions == 0, index, 0).amax(dim=1)  # 0: no padding in the row
        longest = int(torch.where(padding_starts > 0, padding_starts, width).max())
        keep = min(width, math.ceil(longest / self.multiple) * self.multiple)
        return {name: value[:, :keep] for name, value in batch.items()}


def sequence_multiple(seq_len: int, divisor: int, pp: int) -> int:
    """What a padded batch's length is rounded up to (see TrimPadding): ``seq_len`` under pipeline
    parallelism, else the least common multiple of 8 and ``divisor`` (parallelism.seq_len_divisor)."""
    return seq_len if pp > 1 else math.lcm(8, divisor)


def check_loss_mask(has_mask: bool, sft: bool, field: str, path: str, text: bool = False) -> None:
    """Before launch: SFT runs (``data.sft``) read sets with loss masks, other runs sets without."""
    if sft and not has_mask:
        what = "is a text corpus" if text else "is a shard set without loss masks"
        raise ValueError(f"{field}={path!r} {what}, and data.sft=True trains on the loss mask of SFT data; prepare "
                         f"it with --chat / --prompt-field, or set data.sft false")
    if has_mask and not sft:
        raise ValueError(f"{field}={path!r} is an SFT shard set (it has loss masks), and data.sft=False would train "
                         f"on every token of it; set --job.data.sft true, or prepare without --chat")
