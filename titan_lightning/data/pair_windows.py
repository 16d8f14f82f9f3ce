"""The training windows of a set of preference pairs (data/preference.py's docstring: what a
window of pairs holds); apart from the rendering, so that ``prepare --preference`` imports no torch."""

import warnings

import numpy as np
import torch

from titan_lightning.data.shards import TokenSpan
from titan_lightning.data.sft import ConversationWindows, best_fit, pack

PAIR_PACKINGS = ("best_fit", "packed")


class PairWindows(ConversationWindows):
    """The preference samples of a masked shard span written by ``prepare --preference`` (the module
    docstring): whole pairs packed ``packing`` ("best_fit", or "packed": next-fit in order) into
    windows of ``seq_len + 1`` tokens (``first_document``: the set's index of the span's first
    document). A pair longer than the window is left out, with one warning."""

    def __init__(self, tokens: TokenSpan, seq_len: int, pad_id: int, packing: str = "best_fit") -> None:
        if packing not in PAIR_PACKINGS:
            raise ValueError(f"data.sft_packing={packing!r}: preference pairs are packed whole, "
                             f"{' or '.join(PAIR_PACKINGS)}")
        self.tokens, self.seq_len, self.pad_id, self.packing = tokens, seq_len, pad_id, packing
        shards = tokens.shards
        self.ends = shards.document_ends(tokens.start, tokens.stop) - tokens.start
        first_document = len(shards.document_ends(0, tokens.start)) if tokens.start else 0
        skip = first_document % 2  # a rejected answer whose chosen one is in the other split
        chosen = skip + 2 * np.arange((len(self.ends) - skip) // 2)
        begins = np.concatenate([[0], self.ends[:-1]])
        lengths = self.ends[chosen + 1] - begins[chosen]
        fits = lengths <= seq_len + 1
        if not fits.all():
            warnings.warn(f"{int((~fits).sum())} pair(s) of {shards.folder} are longer than training.seq_len + 1 = "
                          f"{seq_len + 1} tokens together and are left out (a pair trains whole); prepare with "
                          f"--max-tokens {(seq_len + 1) // 2}, or raise training.seq_len", stacklevel=2)
        chosen, lengths = chosen[fits], lengths[fits]
        if packing == "best_fit":
            order, first = best_fit(np.cumsum(lengths), seq_len + 1)
        else:
            order, first = np.arange(len(lengths)), pack(np.cumsum(lengths), seq_len + 1)
        # Window k holds documents members[first[k]:first[k + 1]]: its pairs' chosen and rejected answers.
        self.members = np.stack([chosen[order], chosen[order] + 1], axis=1).reshape(-1)
        self.first = 2 * first
        self.first_document = first_document
        self.slots = 2 * int(np.diff(first).max(initial=1))

    def documents(self, index: int) -> tuple[int, np.ndarray]:
        raise ValueError("documents(): a pair window's documents are not consecutive; use spans()")

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = super().__getitem__(index)
        docs = self.members[self.first[index]:self.first[index + 1]]
        lengths = [e - b for b, e in self.spans(index)]
        size = self.seq_len + 1
        slot = np.full(size, -1, dtype=np.int64)
        slot[:sum(lengths)] = np.repeat(np.arange(len(lengths)), lengths)
        labels = sample["labels"].numpy()
        sequence_ids = np.where(labels != -100, slot[1:], -1)  # a label's sequence: that of the token it is
        sequence_docs = np.full(self.slots, -1, dtype=np.int64)
        sequence_docs[:len(docs)] = docs + self.first_document
        return {**sample, "sequence_ids": torch.from_numpy(sequence_ids),
                "sequence_docs": torch.from_numpy(sequence_docs)}
