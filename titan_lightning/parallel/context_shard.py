"""Which tokens a context-parallel rank holds: the load balancers (``headtail``: chunks r and
``2 * cp - 1 - r`` of ``2 * cp``; None: the r-th contiguous slice), the CP group that slices a
batch, and the document ids of the whole sequence gathered back from the slices."""

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from titan_lightning.parallel.collectives import all_gather_autograd


def shard_positions(seq_len: int, cp: int, rank: int, load_balancer: Optional[str] = "headtail",
                    device: Optional[torch.device] = None) -> torch.Tensor:
    """Global positions (int64, increasing) of the tokens CP rank ``rank`` holds."""
    if load_balancer == "headtail":
        if seq_len % (2 * cp):
            raise ValueError(f"sequence length {seq_len} must be divisible by 2 * cp = {2 * cp} for headtail")
        c = seq_len // (2 * cp)
        head = torch.arange(rank * c, (rank + 1) * c, device=device)
        tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
        return torch.cat([head, tail])
    if load_balancer is None:
        if seq_len % cp:
            raise ValueError(f"sequence length {seq_len} must be divisible by cp = {cp}")
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    raise ValueError(f"cp_load_balancer={load_balancer!r}: this attention supports 'headtail' or None")


def _runs(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """Contiguous runs of ``positions``: (local start, local end, global end) each."""
    values = positions.tolist()
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append((start, i, values[i - 1] + 1))
            start = i
    return runs


@dataclass
class ContextParallel:
    """The CP group of one rank and how sequences are sliced over it."""

    group: dist.ProcessGroup
    rank: int
    size: int
    load_balancer: Optional[str] = "headtail"
    # Index tensors per (what, local_len, device, rank): every attention layer of every step
    # asks for the same ones.
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def _cached(self, key: tuple, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def positions(self, local_len: int, device: torch.device, rank: Optional[int] = None) -> torch.Tensor:
        """Global positions of the ``local_len`` tokens of ``rank`` (default: this rank)."""
        rank = self.rank if rank is None else rank
        return self._cached(("positions", local_len, device, rank), lambda: shard_positions(
            local_len * self.size, self.size, rank, self.load_balancer, device))

    def gathered_order(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The permutation that sorts the ranks' slices, concatenated in rank order, by position."""
        return self._cached(("order", local_len, device), lambda: torch.argsort(
            torch.cat([self.positions(local_len, device, r) for r in range(self.size)])))

    def runs(self, local_len: int, device: torch.device) -> list[tuple[int, int, int]]:
        """This rank's contiguous runs of positions (computed once: it reads the positions on the host)."""
        return self._cached(("runs", local_len, device), lambda: _runs(self.positions(local_len, device)))

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of a full-sequence tensor (tokens, labels) along ``dim``."""
        seq_len = tensor.shape[dim]
        positions = shard_positions(seq_len, self.size, self.rank, self.load_balancer, tensor.device)
        return tensor.index_select(dim, positions)


def global_document_ids(position_ids: torch.Tensor, cp: ContextParallel, order: torch.Tensor) -> torch.Tensor:
    """[B, S]: the document of every token of the whole sequence (a new one after every position
    0), from every rank's slice of the positions (``order`` sorts the gathered slices)."""
    gathered = all_gather_autograd(position_ids.contiguous(), 1, cp.group)[:, order]
    return torch.cumsum(gathered == 0, dim=1)
