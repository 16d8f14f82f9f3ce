"""Context parallelism: each rank of the ``cp`` group holds a slice of every sequence.

Sequences are sliced load-balanced for causal attention: with ``headtail`` the sequence is
cut into ``2 * cp`` chunks and rank r holds chunks r and ``2 * cp - 1 - r`` (one cheap and
one expensive chunk each); with ``None`` rank r holds the r-th contiguous slice. Tokens,
labels and RoPE positions are sliced the same way, so every rank computes exact causal
attention for its queries with one of three backends:

- ``allgather``: gather K and V from the whole group (autograd: gradients reduce-scattered
  back), then each contiguous run of local queries attends the keys before it
  (``causal_lower_right``: SDPA's flash/efficient kernels on GPU);
- ``ring``: K and V travel around the group, one block per step; each block's partial
  attention is merged with an online softmax (log-sum-exp);
- ``ulysses``: all-to-all from sequence-sharded to head-sharded, plain causal attention over
  the whole sequence, and back; needs the local head counts divisible by ``cp``.

Collectives are functional collectives inside autograd Functions (torch's own
``context_parallel()`` does not run on CPU); under the fake process group they write
deterministic values (parallel/fake.py patches the entry points used here).
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

BACKENDS = ("allgather", "ring", "ulysses")


# -- which tokens a rank holds -------------------------------------------------------------


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


# -- autograd-aware collectives ------------------------------------------------------------


def _funcol():
    from torch.distributed import _functional_collectives as funcol

    return funcol


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    funcol = _funcol()
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    out = gather(x.movedim(dim, 0).contiguous(), 0, group)
    return funcol.wait_tensor(out).movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    funcol = _funcol()
    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    out = scatter(x.movedim(dim, 0).contiguous(), "sum", 0, group)
    return funcol.wait_tensor(out).movedim(0, dim)


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's ``x`` along ``dim``; the gradient is reduce-scattered back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    funcol = _funcol()
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), None, None, group))


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its own adjoint, so the gradient takes the same way back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def _shift(x: torch.Tensor, group, rank: int, size: int, step: int) -> torch.Tensor:
    """Send ``x`` to rank ``rank + step``, receive the block of rank ``rank - step`` (mod size)."""
    funcol = _funcol()
    n = x.shape[0]
    send = [0] * size
    recv = [0] * size
    send[(rank + step) % size] = n
    recv[(rank - step) % size] = n
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), recv, send, group))


class _RingShift(torch.autograd.Function):
    """One ring step: this rank's block goes to the next rank; gradients go back to the previous."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        ctx.args = (group, rank, size)
        return _shift(x, group, rank, size, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, rank, size = ctx.args
        return _shift(grad, group, rank, size, -1), None, None, None


# -- attention -----------------------------------------------------------------------------


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x.repeat_interleave(n_rep, dim=2) if n_rep > 1 else x


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, backend: str
) -> torch.Tensor:
    """Exact causal attention of this rank's queries over the whole sequence.

    ``q`` [B, S_local, H, D], ``k``/``v`` [B, S_local, H_kv, D] (H a multiple of H_kv, GQA),
    all already rotated with their global positions. Returns [B, S_local, H, D].
    """
    if backend == "allgather":
        return _allgather_attention(q, k, v, cp)
    if backend == "ring":
        return _ring_attention(q, k, v, cp)
    if backend == "ulysses":
        return _ulysses_attention(q, k, v, cp)
    raise ValueError(f"context-parallel attention backend {backend!r} is not one of {', '.join(BACKENDS)}")


def _allgather_attention(q, k, v, cp: ContextParallel) -> torch.Tensor:
    local = q.shape[1]
    order = cp.gathered_order(local, q.device)
    n_rep = q.shape[2] // k.shape[2]
    # Gather before repeating the KV heads: GQA sends n_heads / n_kv_heads times less.
    k_all = _repeat_kv(_AllGather.apply(k, 1, cp.group)[:, order], n_rep).transpose(1, 2)
    v_all = _repeat_kv(_AllGather.apply(v, 1, cp.group)[:, order], n_rep).transpose(1, 2)
    q = q.transpose(1, 2)
    outs = []
    for start, end, global_end in cp.runs(local, q.device):
        # Queries at positions [global_end - (end - start), global_end) see keys [0, global_end).
        mask = causal_lower_right(end - start, global_end)
        outs.append(F.scaled_dot_product_attention(q[:, :, start:end], k_all[:, :, :global_end],
                                                   v_all[:, :, :global_end], attn_mask=mask))
    return torch.cat(outs, dim=2).transpose(1, 2)


def _ring_attention(q, k, v, cp: ContextParallel) -> torch.Tensor:
    local, n_rep = q.shape[1], q.shape[2] // k.shape[2]
    q_pos = cp.positions(local, q.device)
    # Scores, softmax statistics and the running output in fp32 at least (as flash kernels
    # do): bf16 log-sum-exp merging would lose the low bits of every block.
    acc = torch.promote_types(q.dtype, torch.float32)
    qt = q.transpose(1, 2).to(acc)  # [B, H, S, D]
    scale = 1.0 / math.sqrt(q.shape[-1])
    # A large finite negative, not -inf: fully masked rows then carry weight exp(-huge) == 0
    # and finite gradients.
    masked = torch.finfo(acc).min / 2
    out = lse = None
    block_k, block_v = k, v
    for step in range(cp.size):
        source = (cp.rank - step) % cp.size
        k_pos = cp.positions(local, q.device, source)
        kt = _repeat_kv(block_k, n_rep).transpose(1, 2).to(acc)
        vt = _repeat_kv(block_v, n_rep).transpose(1, 2).to(acc)
        scores = (qt @ kt.transpose(-2, -1)) * scale
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], masked)
        block_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        block_out = torch.exp(scores - block_lse) @ vt
        if out is None:  # step 0 is this rank's own block: every query sees itself, lse is finite
            out, lse = block_out, block_lse
        else:
            new_lse = torch.logaddexp(lse, block_lse)
            out = out * torch.exp(lse - new_lse) + block_out * torch.exp(block_lse - new_lse)
            lse = new_lse
        if step + 1 < cp.size:
            block_k = _RingShift.apply(block_k, cp.group, cp.rank, cp.size)
            block_v = _RingShift.apply(block_v, cp.group, cp.rank, cp.size)
    return out.transpose(1, 2).to(q.dtype)


def _to_heads(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[B, S_local, H, D] sequence-sharded -> [B, S, H / cp, D] head-sharded, positions sorted."""
    B, S, H, D = x.shape
    parts = x.view(B, S, cp.size, H // cp.size, D).permute(2, 0, 1, 3, 4)  # [cp, B, S_local, H/cp, D]
    gathered = _AllToAll.apply(parts, cp.group)  # chunk j: rank j's tokens, my heads
    whole = gathered.permute(1, 0, 2, 3, 4).reshape(B, cp.size * S, H // cp.size, D)
    return whole[:, cp.gathered_order(S, x.device)]


def _to_sequence(x: torch.Tensor, cp: ContextParallel, local: int) -> torch.Tensor:
    """Inverse of ``_to_heads``: [B, S, H / cp, D] -> [B, S_local, H, D]."""
    B, _, h, D = x.shape
    unsorted = x[:, torch.argsort(cp.gathered_order(local, x.device))]
    parts = unsorted.view(B, cp.size, local, h, D).permute(1, 0, 2, 3, 4)  # chunk j: rank j's tokens
    back = _AllToAll.apply(parts, cp.group)  # chunk j: my tokens, rank j's heads
    return back.permute(1, 2, 0, 3, 4).reshape(B, local, cp.size * h, D)


def _ulysses_attention(q, k, v, cp: ContextParallel) -> torch.Tensor:
    local = q.shape[1]
    if q.shape[2] % cp.size or k.shape[2] % cp.size:
        raise ValueError(
            f"ulysses attention needs the local query heads ({q.shape[2]}) and KV heads ({k.shape[2]}) "
            f"divisible by cp={cp.size}"
        )
    n_rep = q.shape[2] // k.shape[2]
    qh, kh, vh = (_to_heads(t, cp) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qh.transpose(1, 2), _repeat_kv(kh, n_rep).transpose(1, 2), _repeat_kv(vh, n_rep).transpose(1, 2),
        is_causal=True,
    )
    return _to_sequence(out.transpose(1, 2), cp, local)


def apply_context_parallel(model: torch.nn.Module, mesh, load_balancer: Optional[str]) -> ContextParallel:
    """Give every attention module of ``model`` the CP group; refuse models that cannot do CP.

    Attention modules are those with ``backend`` and ``cp`` attributes (models/common/attention.py).
    All must use one context-parallel backend.
    """
    from titan_lightning.config import ConfigError

    modules = [m for m in model.modules() if hasattr(m, "backend") and hasattr(m, "cp")]
    size = mesh.size()
    if not modules:
        raise ConfigError(f"parallelism.cp={size}: {type(model).__name__} has no attention module that can do CP")
    backends = sorted({m.backend for m in modules})
    non_cp = [b for b in backends if b not in BACKENDS]
    if non_cp:
        raise ConfigError(
            f"parallelism.cp={size} but the model has attention {non_cp[0]!r}, which cannot do CP; "
            f"apply ContextParallelTransform(attention=...) with one of {', '.join(BACKENDS)}"
        )
    if len(backends) > 1:
        raise ConfigError(f"one model mixes the context-parallel attentions {backends}; use one backend")
    context = ContextParallel(group=mesh.get_group(), rank=mesh.get_local_rank(), size=size,
                              load_balancer=load_balancer)
    for module in modules:
        module.cp = context
    return context
