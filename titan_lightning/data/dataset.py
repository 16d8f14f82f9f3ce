"""From a text corpus to batches of next-token windows.

A corpus is one UTF-8 text file; documents are separated by ``<|endoftext|>`` (the shipped
corpus writes it on its own line, as ``DOC_SEPARATOR``). The train/val split is by
documents: validation is the shortest tail of documents that holds at least
``val_fraction`` of the corpus characters.

Each split is tokenized on its own into one stream, every document followed by the
end-of-text token. Window ``i`` of a stream is ``tokens[i * seq_len : i * seq_len + seq_len + 1]``
(consecutive windows share one token, so every token but the first is a label exactly
once); its sample is ``input_ids = window[:-1]``, ``labels = window[1:]``.

Data-parallel rank ``r`` of ``n`` reads global samples ``r, r + n, r + 2n, ...``. In
training the global order is the concatenation of epochs, epoch ``e`` visiting every
window once in the permutation seeded by ``(seed, e)``; in validation it is the windows
in order, cut to a multiple of ``n`` so that every rank runs the same number of batches.

A run limited by steps reads that order as one endless stream (``TrainStream``). A run limited by
epochs (``EpochStream``) trains whole optimizer steps: each epoch is its permutation's first
``steps_per_epoch * samples_per_step`` windows, the rest (fewer than one step, a different set each
epoch as the order is reshuffled) left out, so that every rank runs the same number of microbatches
and every step holds the same samples on any layout of the same global batch.
"""

from typing import Iterator, Optional, Protocol, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from titan_lightning.models.common.loss import IGNORE_INDEX
from titan_lightning.data.text import DOC_SEPARATOR, EOT, format_corpus, read_documents, split_documents  # noqa: F401

class _Encoder(Protocol):
    eot_id: int

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


def tokenize_documents(documents: Sequence[str], tokenizer: _Encoder) -> np.ndarray:
    """One int32 token stream: every document followed by the end-of-text token (and preceded by
    BOS when the tokenizer adds one, ``add_bos``)."""
    ids = tokenizer.encode_batch(documents)
    head = (tokenizer.bos_id,) if getattr(tokenizer, "add_bos", False) else ()
    return np.fromiter(
        (token for doc in ids for token in (*head, *doc, tokenizer.eot_id)),
        dtype=np.int32,
        count=sum(len(head) + len(doc) + 1 for doc in ids),
    )


class TokenWindows(Dataset):
    """The next-token samples of one token stream, in stream order.

    With ``eot_id`` (every document of the stream ends with it), a sample also carries the
    document boundaries: ``position_ids``, each input token's position in its document, 0 where
    a document starts (after an end-of-text token); the document the window starts inside
    counts from the window's first token. Document-masked attention and per-document RoPE
    positions read them.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, eot_id: Optional[int] = None) -> None:
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill one window of seq_len + 1 = {seq_len + 1} tokens")
        self.tokens = tokens
        self.seq_len = seq_len
        self.eot_id = eot_id

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = index * self.seq_len
        tokens = self.tokens[start : start + self.seq_len + 1]
        window = torch.from_numpy(tokens).long()
        sample = {"input_ids": window[:-1], "labels": window[1:]}
        if self.eot_id is not None:
            sample["position_ids"] = torch.from_numpy(document_positions(tokens[:-1], self.eot_id))
        return sample


def document_positions(tokens: np.ndarray, eot_id: int) -> np.ndarray:
    """Each token's position in its document (0 after every ``eot_id``, and at the first token)."""
    index = np.arange(len(tokens))
    starts = np.flatnonzero(np.concatenate([[True], np.asarray(tokens[:-1]) == eot_id]))
    return index - starts[np.searchsorted(starts, index, side="right") - 1]


def epoch_permutation(num_windows: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which training epoch ``epoch`` visits the windows of an in-memory stream."""
    return np.random.default_rng([seed, epoch]).permutation(num_windows)


_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a 64-bit integer hash."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


class FeistelPermutation:
    """A seeded permutation of ``range(n)`` computed index by index (``perm[i]``), in constant
    memory: a 4-round Feistel network on the smallest even-width bit domain holding ``n``, walked
    until it lands inside ``range(n)``. Token shard sets use it, so the shuffle of a corpus of any
    size costs no memory."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.keys = [_mix(_mix(seed & _MASK64) ^ _mix(epoch * 4 + r + 1)) for r in range(4)]

    def __len__(self) -> int:
        return self.n

    def _encrypt(self, x: int) -> int:
        mask = (1 << self.half) - 1
        left, right = x >> self.half, x & mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << self.half) | right

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} outside a permutation of {self.n}")
        x = self._encrypt(i)
        while x >= self.n:  # at most 4n domain: a few steps on average
            x = self._encrypt(x)
        return x


def epoch_order(windows: "TokenWindows", seed: int, epoch: int):
    """The order of epoch ``epoch`` over ``windows``: an array for an in-memory stream (the order
    every committed golden file was recorded with), a FeistelPermutation for a shard set."""
    if isinstance(windows.tokens, np.ndarray):
        return epoch_permutation(len(windows), seed, epoch)
    return FeistelPermutation(len(windows), seed, epoch)


class TrainStream(IterableDataset):
    """Infinite shuffled training samples of one data-parallel rank.

    ``start`` is the number of samples this rank has already consumed; iteration resumes
    exactly there. ``batch_size`` is only used to hand whole batches to DataLoader
    workers, so that any ``num_workers`` yields the same batches in the same order.
    """

    def __init__(
        self,
        windows: TokenWindows,
        *,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        start: int = 0,
        batch_size: int = 1,
    ) -> None:
        _check_shard(dp_rank, dp_size)
        if start < 0:
            raise ValueError(f"start={start} must be >= 0")
        self.windows = windows
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.start = start
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        n = len(self.windows)
        epoch, order = -1, np.empty(0, dtype=np.int64)
        for k in _worker_positions(self.start, None, self.batch_size):
            position = k * self.dp_size + self.dp_rank
            if position // n != epoch:
                epoch = position // n
                order = epoch_order(self.windows, self.seed, epoch)
            yield self.windows[int(order[position % n])]


class EpochStream(TrainStream):
    """One epoch of shuffled training samples of one data-parallel rank per iteration.

    ``epoch_samples`` is the samples this rank trains in an epoch (steps per epoch x microbatches
    per step x microbatch size); the ``dp_size`` ranks together take the first ``epoch_samples *
    dp_size`` windows of each epoch's order. An iteration yields from ``start`` (this rank's samples
    consumed over all epochs) to the end of the epoch it falls in: set ``start`` before each
    iteration (the data module's loader does) to continue where training is.
    """

    def __init__(self, windows: TokenWindows, *, epoch_samples: int, **kwargs) -> None:
        super().__init__(windows, **kwargs)
        if not 0 < epoch_samples * self.dp_size <= len(windows):
            raise ValueError(f"epoch_samples={epoch_samples} on {self.dp_size} data-parallel ranks must take "
                             f"between 1 and the {len(windows)} windows")
        self.epoch_samples = epoch_samples

    def __len__(self) -> int:
        return self.epoch_samples

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch = self.start // self.epoch_samples
        first = epoch * self.epoch_samples
        order = epoch_order(self.windows, self.seed, epoch)
        for k in _worker_positions(self.start - first, self.epoch_samples, self.batch_size):
            yield self.windows[int(order[k * self.dp_size + self.dp_rank])]


class ValWindows(IterableDataset):
    """Validation samples of one data-parallel rank: windows ``r, r + n, ...``, in order, finite.

    Every rank has ``len(self)`` samples (each rank runs the same forwards: sharded models gather
    their parameters together): the last ranks' missing ones are copies of window 0 with every label
    ignored, which add nothing to the loss nor to its token count. So every held-out window is
    validated on any number of ranks, and a held-out set smaller than the ranks works.
    """

    def __init__(self, windows: TokenWindows, *, dp_rank: int = 0, dp_size: int = 1, batch_size: int = 1) -> None:
        _check_shard(dp_rank, dp_size)
        if len(windows) == 0:
            raise ValueError("no validation windows")
        self.windows = windows
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-len(self.windows) // self.dp_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for k in _worker_positions(0, len(self), self.batch_size):
            index = k * self.dp_size + self.dp_rank
            yield self.windows[index] if index < len(self.windows) else _ignored(self.windows[0])


def _ignored(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sample`` with every label ignored (a rank's filler validation sample)."""
    return {name: torch.full_like(value, IGNORE_INDEX) if name == "labels" else value.clone()
            for name, value in sample.items()}


def _check_shard(dp_rank: int, dp_size: int) -> None:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")


def _worker_positions(start: int, stop: Optional[int], batch_size: int) -> Iterator[int]:
    """This rank's sample positions from ``start`` that the current DataLoader worker serves.

    Worker ``w`` of ``W`` takes batches ``w, w + W, ...``; the DataLoader collects workers
    round-robin, so the batches come out in the order a single process would give.
    """
    info = get_worker_info()
    worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
    first = start + worker * batch_size
    while stop is None or first < stop:
        last = first + batch_size if stop is None else min(first + batch_size, stop)
        yield from range(first, last)
        first += workers * batch_size
