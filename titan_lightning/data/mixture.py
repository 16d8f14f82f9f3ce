"""Several sources with weights as one deterministic training sequence.

The global sequence of training samples (rank ``r`` of ``n`` reads positions ``r, r + n, ...``,
as with one source) is cut into blocks of ``B`` positions. The samples each source has before
position ``p`` are the largest-remainder apportionment of ``p`` by the weights at block ends,
so every prefix of whole blocks holds each source within one sample of its share; inside a
block the sources' samples are placed in an order seeded by ``(seed, block)``. Source ``s``
serves its own windows in epochs, each a permutation seeded by ``(seed, s, epoch)``.

Everything is a function of the position, so a resumed run, on any data-parallel size,
continues exactly. Changed weights at a resume: every source continues from the sample it had
reached (nothing repeated or skipped), and the new weights apply from the resumed position on
(the schedule restarts there, with the counts reached so far as its base).
"""

import math
from fractions import Fraction
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset

from titan_lightning.data.dataset import TokenWindows, _check_shard, _worker_positions, epoch_order


class MixtureSchedule:
    """Which source, and which of its samples, each global position ``p >= base_position`` holds."""

    def __init__(self, weights: Sequence[float], seed: int, base_position: int = 0,
                 base_counts: Optional[Sequence[int]] = None) -> None:
        if not weights or any(not w > 0 for w in weights):
            raise ValueError(f"mixture weights {list(weights)} must all be > 0")
        exact = [Fraction(w).limit_denominator(10**6) for w in weights]
        self.weights = [w / sum(exact) for w in exact]
        self.seed, self.base_position = seed, base_position
        self.base_counts = np.asarray(base_counts if base_counts is not None else [0] * len(weights), dtype=np.int64)
        self.block = max(1024, math.ceil(1 / min(self.weights)))
        self._cached: tuple[int, np.ndarray, np.ndarray] = (-1, np.empty(0, np.int64), np.empty(0, np.int64))

    def apportion(self, total: int) -> np.ndarray:
        """Samples of each source among ``total`` (largest remainders; ties to the lower index)."""
        shares = [total * w for w in self.weights]
        counts = [math.floor(s) for s in shares]
        by_remainder = sorted(range(len(shares)), key=lambda i: (-(shares[i] - counts[i]), i))
        for i in by_remainder[: total - sum(counts)]:
            counts[i] += 1
        return np.asarray(counts, dtype=np.int64)

    def _block(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``j``'s source per offset, and each offset's rank among its source's in the block."""
        if self._cached[0] != j:
            sizes = self.apportion((j + 1) * self.block) - self.apportion(j * self.block)
            labels = np.repeat(np.arange(len(sizes)), sizes)
            np.random.default_rng([self.seed, 7919, j]).shuffle(labels)
            ranks = np.empty_like(labels)
            for s in range(len(sizes)):
                where = np.flatnonzero(labels == s)
                ranks[where] = np.arange(len(where))
            self._cached = (j, labels, ranks)
        return self._cached[1], self._cached[2]

    def locate(self, position: int) -> tuple[int, int]:
        """(source, the index of the source's sample) at global ``position``."""
        j, offset = divmod(position - self.base_position, self.block)
        labels, ranks = self._block(j)
        s = int(labels[offset])
        return s, int(self.base_counts[s] + self.apportion(j * self.block)[s] + ranks[offset])

    def counts_at(self, position: int) -> np.ndarray:
        """Samples of each source among the global positions before ``position``."""
        j, offset = divmod(position - self.base_position, self.block)
        labels, _ = self._block(j)
        return self.base_counts + self.apportion(j * self.block) + np.bincount(labels[:offset], minlength=len(self.weights))


class MixtureStream(IterableDataset):
    """Infinite training samples of one data-parallel rank from several sources (see the module
    docstring); ``start`` and ``batch_size`` as in TrainStream."""

    def __init__(self, sources: Sequence[TokenWindows], schedule: MixtureSchedule, *, seed: int, dp_rank: int = 0,
                 dp_size: int = 1, start: int = 0, batch_size: int = 1) -> None:
        _check_shard(dp_rank, dp_size)
        self.sources, self.schedule, self.seed = list(sources), schedule, seed
        self.dp_rank, self.dp_size, self.start, self.batch_size = dp_rank, dp_size, start, batch_size

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        orders: dict[tuple[int, int], object] = {}
        for k in _worker_positions(self.start, None, self.batch_size):
            s, index = self.schedule.locate(k * self.dp_size + self.dp_rank)
            windows = self.sources[s]
            epoch, within = divmod(index, len(windows))
            if (s, epoch) not in orders:
                orders = {key: v for key, v in orders.items() if key[0] != s}
                orders[(s, epoch)] = epoch_order(windows, _source_seed(self.seed, s), epoch)
            yield windows[int(orders[(s, epoch)][within])]


def _source_seed(seed: int, source: int) -> int:
    return seed * 1000003 + source


class ConcatWindows:
    """Several TokenWindows as one (validation over every source, in source order)."""

    def __init__(self, parts: Sequence[TokenWindows]) -> None:
        self.parts = list(parts)
        self.ends = np.cumsum([len(p) for p in self.parts]).tolist()
        self.seq_len = self.parts[0].seq_len

    def __len__(self) -> int:
        return self.ends[-1]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        k = int(np.searchsorted(self.ends, index, side="right"))
        return self.parts[k][index - (self.ends[k - 1] if k else 0)]
