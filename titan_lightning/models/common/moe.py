"""Mixture of experts: a token-choice top-k router, grouped SwiGLU experts, shared experts,
and auxiliary-loss-free load balancing.

    x [B, S, dim] -> tokens [T, dim]
    router:   scores [T, E] (softmax or sigmoid of gate(x)); the top_k experts of each token,
              picked on scores + expert_bias (the bias steers selection only); with expert
              groups, only from the token's top_k_groups best groups (DeepSeek V3)
    experts:  the T * top_k (token, expert) pairs sorted by expert, one SwiGLU per expert
              (``torch._grouped_mm`` where torch has it for the device and dtype, each expert's
              rows padded to ``token_group_align``; an exact per-expert loop elsewhere)
    combine:  each token's top_k outputs weighted by their scores and summed, in a fixed
              order (no atomic adds: deterministic), plus the shared experts' output

Expert weights are stacked: ``w1``/``w3`` [E, hidden, dim], ``w2`` [E, dim, hidden] (each
slice is a Hugging Face per-expert ``Linear.weight``). Expert parallelism sets
``GroupedExperts.ep``; it then receives this rank's sorted tokens with the per-expert
counts over all experts and exchanges them with the ranks that hold those experts.
Expert tensor parallelism (tp > 1, ep = 1) sets ``MoE.etp``: the experts' hidden dim is
split over the TP ranks, which gather each other's routed tokens (parallel/expert.py).

No host synchronization on the token path (one device, grouped GEMM): the counts come from a
one-hot sum (``torch.bincount`` reads the largest id on the host to size its output on CUDA),
the sort is an ``argsort``, and the padded layout (``pad_groups``) is built from the counts
with ``cumsum``/``searchsorted`` into static sizes: N rows sorted by expert become
N + E * (align - 1) rows, each expert's group a multiple of ``align`` rows, so neither the
grouped GEMM's offsets nor any shape depends on a value read back from the device (the layer
is compile-friendly on GPUs; torch's grouped GEMM meta function accepts bf16 only). The
per-expert loop reads the counts on the host; it stays as the reference and for dtypes the
grouped GEMM lacks (float64; float32 on CUDA).

Load balancing (DeepSeek V3's auxiliary-loss-free method): every training forward adds
its per-expert token counts to ``tokens_per_expert``; after each optimizer step
``update_expert_bias`` sums them over the ranks and moves ``expert_bias`` by
``load_balance_coeff`` toward the experts that got fewer tokens than the mean.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titan_lightning.models.common.feedforward import FeedForward
from titan_lightning.parallel import value_free

SCORE_FUNCS = ("softmax", "sigmoid")
# The experts' gated activation: SwiGLU, silu(gate) * up; or gpt-oss's clamped SwiGLU,
# (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit).
ACTIVATIONS = ("silu", "clamped_swiglu")

# Tensor-parallel plan entries for MoE layers at ``layers.*.moe`` (parallel/tensor_styles.py styles):
# under sequence parallelism each TP rank routes its own tokens (the routed experts are
# expert-parallel); the router gate and the shared experts are replicated per-token modules.
MOE_TP_PLAN: dict[str, str] = {
    "layers.*.moe": "moe",
    "layers.*.moe.router.gate": "moe_replicated",
    "layers.*.moe.shared_experts.*": "moe_replicated",
}


@dataclass(kw_only=True)
class MoEArgs:
    num_experts: int = 8
    top_k: int = 2
    # Width of each routed expert's SwiGLU.
    hidden_dim: int = 256
    # Shared experts see every token; together one SwiGLU num_shared_experts * hidden_dim wide.
    num_shared_experts: int = 0
    score_func: str = "softmax"
    # Divide each token's top-k scores by their sum.
    route_norm: bool = False
    route_scale: float = 1.0
    # Scale the expert inputs by the scores instead of the outputs.
    score_before_experts: bool = False
    # Step size of the load-balancing bias; None disables it (pure top-k on the scores).
    load_balance_coeff: Optional[float] = 1e-3
    # Group-limited routing (DeepSeek V3's n_group / topk_group): the experts form num_groups
    # equal groups, each scored by the sum of its 2 best (biased) scores; a token picks its
    # top_k experts from its top_k_groups best groups only. 1 / 1: no groups.
    num_groups: int = 1
    top_k_groups: int = 1
    # The routed experts' kernel: torch's grouped GEMM (True), the per-expert loop (False), or
    # None: the grouped GEMM where it is fast (bf16 on Hopper-class GPUs), the loop elsewhere (on
    # CPU the loop's numerics are the committed goldens'). True also runs torch's CPU grouped GEMM
    # (float32/bf16/float16); dtypes it lacks (float64; float32 on CUDA) take the loop.
    use_grouped_mm: Optional[bool] = None
    # Rows each expert's group is padded to a multiple of for the grouped GEMM (torchtitan's
    # TOKEN_GROUP_ALIGN_SIZE_M). None: 16 bytes of the compute dtype on CUDA (8 rows of bf16),
    # 1 (no padding) on CPU. Padding never changes the result; it costs up to
    # num_experts * (align - 1) zero rows per layer.
    token_group_align: Optional[int] = None
    # gpt-oss: a bias on the router's logits and on each expert's three projections (``b1``/``b3``
    # [E, hidden], ``b2`` [E, dim]), and the clamped SwiGLU (``activation``, ``swiglu_alpha``,
    # ``swiglu_limit``; ACTIVATIONS).
    router_bias: bool = False
    expert_biases: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"moe.activation={self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        for name in ("swiglu_alpha", "swiglu_limit"):
            if not getattr(self, name) > 0:
                raise ValueError(f"moe.{name}={getattr(self, name)!r} must be > 0")
        for name in ("num_experts", "top_k", "hidden_dim", "num_groups", "top_k_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"moe.{name}={value!r} must be a positive integer")
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k={self.top_k} must be <= moe.num_experts={self.num_experts}")
        if self.token_group_align is not None and (not isinstance(self.token_group_align, int)
                                                   or isinstance(self.token_group_align, bool)
                                                   or self.token_group_align < 1):
            raise ValueError(f"moe.token_group_align={self.token_group_align!r} must be a positive integer "
                             "(e.g. 8, 16, 128), or None for the device's default")
        if self.use_grouped_mm not in (None, True, False):
            raise ValueError(f"moe.use_grouped_mm={self.use_grouped_mm!r} must be true, false or None (automatic)")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(f"moe.num_shared_experts={self.num_shared_experts!r} must be an integer >= 0")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"moe.score_func={self.score_func!r} is not one of {', '.join(SCORE_FUNCS)}")
        if self.load_balance_coeff is not None and not self.load_balance_coeff > 0:
            raise ValueError(f"moe.load_balance_coeff={self.load_balance_coeff} must be > 0, or None to disable")
        if self.top_k_groups > self.num_groups:
            raise ValueError(f"moe.top_k_groups={self.top_k_groups} must be <= moe.num_groups={self.num_groups}")
        if self.num_experts % self.num_groups:
            raise ValueError(f"moe.num_groups={self.num_groups} must divide moe.num_experts={self.num_experts}")
        per_group = self.num_experts // self.num_groups
        if self.num_groups > 1 and per_group < 2:
            raise ValueError(f"moe.num_groups={self.num_groups} leaves 1 expert per group (groups are scored by "
                             f"their 2 best experts): use at most {self.num_experts // 2} groups, or 1")
        if self.top_k > self.top_k_groups * per_group:
            raise ValueError(f"moe.top_k={self.top_k} must be <= moe.top_k_groups={self.top_k_groups} x "
                             f"{per_group} experts per group")


class TokenChoiceTopKRouter(nn.Module):
    """Each token picks its ``top_k`` experts; returns (scores [T, k], experts [T, k], counts [E]).

    With ``top_k_groups < num_groups`` the choice is group-limited as in transformers'
    DeepseekV3TopkRouter: each group of ``num_experts / num_groups`` experts scores the sum of its
    2 best choice scores, the ``top_k_groups`` best groups are kept, the other experts' choice
    scores become -inf, then the top_k of all experts are taken."""

    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: str = "softmax",
                 route_norm: bool = False, route_scale: float = 1.0, num_groups: int = 1, top_k_groups: int = 1,
                 bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=bias)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.num_groups, self.top_k_groups = num_groups, top_k_groups

    def forward(self, x: torch.Tensor, expert_bias: Optional[torch.Tensor] = None):
        logits = self.gate(x).float()
        scores = torch.softmax(logits, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits)
        grouped = self.top_k_groups < self.num_groups
        if expert_bias is None and not grouped:
            top_scores, experts = torch.topk(scores, self.top_k, dim=-1)
        else:  # the bias and the groups pick the experts; the weights stay the unbiased scores
            choice = scores if expert_bias is None else scores + expert_bias
            experts = torch.topk(self.in_best_groups(choice) if grouped else choice, self.top_k, dim=-1).indices
            top_scores = scores.gather(-1, experts)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        return top_scores, experts, routed_counts(experts, self.num_experts)

    def in_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` [T, E] with -inf for every expert outside the token's ``top_k_groups`` best groups."""
        groups = choice.unflatten(-1, (self.num_groups, -1))  # [T, G, E / G]
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        best = torch.topk(group_scores, self.top_k_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
        return groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


def count_tokens(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of ``experts`` name each expert: [num_experts] int64, on the device.

    A sum of one-hot rows: sync-free, where ``torch.bincount`` reads the largest id on the host to
    size its output on CUDA, and with no atomics (nothing for deterministic mode to refuse);
    [N, E] booleans, a few MB for a rank's pairs."""
    flat = experts.flatten()
    return (flat[:, None] == torch.arange(num_experts, device=flat.device)).sum(dim=0)


def routed_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``count_tokens`` of the router's choice, or, while tensors hold no values, what is assumed
    (parallel/value_free.py)."""
    assumed = value_free.assumed()
    return count_tokens(experts, num_experts) if assumed is None else assumed.count_tokens(experts, num_experts)


@dataclass(frozen=True)
class PaddedGroups:
    """Where ``pad_groups`` puts each row; every index lives on the device.

    ``source`` [padded_rows]: the sorted row each padded row takes, or ``rows`` (a zero row
    appended to the input) for padding; ``position`` [rows]: the padded row each sorted row
    lands on; ``ends`` [E] int32: each group's end in the padded rows (the grouped GEMM's
    ``offs``), the last one ``padded_rows``: every row is computed, none left undefined.
    With ``align`` 1 the layout is the input's own: ``source`` and ``position`` are None."""

    source: Optional[torch.Tensor]
    position: Optional[torch.Tensor]
    ends: torch.Tensor


def padded_rows(rows: int, num_groups: int, align: int) -> int:
    """The static size of ``pad_groups``' layout: each group adds at most ``align - 1`` rows."""
    return rows + num_groups * (align - 1)


def pad_groups(counts: torch.Tensor, rows: int, align: int) -> PaddedGroups:
    """The grouped GEMM's layout of ``rows`` rows sorted into groups of ``counts`` [E] rows
    (``sum(counts) <= rows``: the rows past it trail the last group), each group padded to a
    multiple of ``align`` rows, in ``padded_rows(rows, E, align)`` rows.

    Built from the counts on the device (``cumsum``, ``searchsorted``, ``where``): no value is
    read on the host and every shape is static, on one device and under expert parallelism
    alike. A padding row copies the zero row, so its output is zero and it adds nothing to any
    gradient."""
    num_groups, device = counts.numel(), counts.device
    total = padded_rows(rows, num_groups, align)
    counts = counts.to(torch.int64)
    # The rows past sum(counts) (expert parallelism's empty slots) join the last group.
    counts = torch.cat([counts[:-1], counts[-1:] + (rows - counts.sum())])
    ends = torch.cumsum(counts, dim=0)
    if align == 1:
        return PaddedGroups(source=None, position=None, ends=ends.to(torch.int32))
    starts = ends - counts
    padded = (counts + align - 1) // align * align
    padded_ends = torch.cumsum(padded, dim=0)
    padded_starts = padded_ends - padded
    row = torch.arange(rows, device=device)
    group = torch.searchsorted(ends, row, right=True).clamp_(max=num_groups - 1)
    position = padded_starts[group] + (row - starts[group])
    slot = torch.arange(total, device=device)
    group = torch.searchsorted(padded_ends, slot, right=True).clamp_(max=num_groups - 1)
    within = slot - padded_starts[group]
    source = torch.where(within < counts[group], starts[group] + within, rows)
    # The last group also takes the padding at the end (zero rows), so every output is defined.
    offsets = torch.cat([padded_ends[:-1], padded_ends.new_full((1,), total)]).to(torch.int32)
    return PaddedGroups(source=source, position=position, ends=offsets)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs bf16 on Hopper-class GPUs and newer (the automatic choice); while
    tensors hold no values, what is assumed (parallel/value_free.py)."""
    assumed = value_free.assumed()
    if assumed is not None:
        return assumed.grouped_mm(x)
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs at all: on those GPUs, and in float32, bf16 and float16 on
    CPUs where torch has its CPU kernel (``mm`` over the groups; elementwise ops over all groups
    at once round a few last bits unlike the loop's per-expert ones)."""
    if grouped_mm_available(x):
        return True
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and CPU_GROUPED_MM


def _probe_cpu_grouped_mm() -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        torch._grouped_mm(torch.zeros(2, 4), torch.zeros(1, 4, 4), offs=torch.tensor([2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


# Probed once at import: compiled code reads a constant instead of tracing the probe.
CPU_GROUPED_MM = _probe_cpu_grouped_mm()


def default_token_group_align(x: torch.Tensor) -> int:
    """16 bytes of rows' worth on CUDA (8 rows of bf16, torchtitan's default), no padding on CPU."""
    return max(1, 16 // x.element_size()) if x.is_cuda else 1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts in stacked weights; tokens arrive sorted by expert.

    ``use_grouped_mm`` and ``token_group_align``: ``MoEArgs``' fields of those names;
    ``biases`` adds ``b1``/``b3`` [E, hidden] and ``b2`` [E, dim] (sharded with the weights
    under expert parallelism); ``activation``: ``MoEArgs.activation`` and its two constants."""

    routed_experts = True  # what expert parallelism shards (parallel/expert.py)

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, *, use_grouped_mm: Optional[bool] = None,
                 token_group_align: Optional[int] = None, biases: bool = False, activation: str = "silu",
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm, self.token_group_align = use_grouped_mm, token_group_align
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, swiglu_alpha, swiglu_limit
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        if biases:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b2 = nn.Parameter(torch.empty(num_experts, dim))
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim))
        else:
            self.b1 = self.b2 = self.b3 = None
        # Set by expert parallelism (parallel/expert.py): dispatch, compute locally, combine.
        self.ep = None
        # Factor on the weights' gradients (set with expert FSDP: parallel/fsdp.py).
        self.grad_scale = 1.0
        # LoRA on the experts (titan_lightning/lora/experts.py): (self, (w1, w2, w3)) -> the weights
        # the experts compute with, each plus its adapters' update.
        self.adapt = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim] sorted by expert, ``counts`` [num_experts] tokens per expert -> [N, dim]."""
        if self.ep is not None:
            return self.ep.run(self, x, counts)
        return self.compute(x, counts)

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's expert weights as plain tensors in ``dtype`` (the local shard under EP)."""
        weights = [_local(w).to(dtype) for w in (self.w1, self.w2, self.w3)]
        if self.adapt is not None:
            weights = list(self.adapt(self, weights))
        if self.grad_scale != 1.0:
            weights = [_ScaleGrad.apply(w, self.grad_scale) for w in weights]
        return tuple(weights)

    def biases(self, dtype: torch.dtype) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(b1, b2, b3)`` as ``weights`` gives the weights, or None without biases."""
        if self.b1 is None:
            return None
        biases = [_local(b).to(dtype) for b in (self.b1, self.b2, self.b3)]
        if self.grad_scale != 1.0:
            biases = [_ScaleGrad.apply(b, self.grad_scale) for b in biases]
        return tuple(biases)

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The activation of the gate and up projections (``MoEArgs.activation``)."""
        if self.activation == "silu":
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(-self.swiglu_limit, self.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))

    def compute(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The local experts on their tokens: ``x`` [N, dim] sorted by local expert, ``counts``
        over the local experts. ``sum(counts) <= N``: the rows past it (expert parallelism's
        empty slots) must be zeros; their outputs are zeros.

        The grouped GEMM as ``use_grouped_mm`` says (no host read: ``pad_groups``), else the
        per-expert loop (reads ``counts`` on the host). Under autocast the experts compute
        in autocast's dtype, as its matmuls would: the grouped GEMM is not on autocast's list,
        and fp32 inputs would send a bf16 run down the loop."""
        x = x.to(_compute_dtype(x))
        w1, w2, w3 = self.weights(x.dtype)
        # (None: the plain SwiGLU's code path, as without these options)
        biases, gated = self.biases(x.dtype), (None if self.activation == "silu" and self.b1 is None else self.gated)
        if self.grouped(x) and _fits_grouped_mm(x, w1):
            align = self.token_group_align or default_token_group_align(x)
            return _grouped_swiglu(x, counts, w1, w2, w3, align, biases, gated)
        return _looped_swiglu(x, counts, w1, w2, w3, biases, gated)

    def grouped(self, x: torch.Tensor) -> bool:
        """Whether tokens like ``x`` (in the compute dtype) take the grouped GEMM."""
        if self.use_grouped_mm is None:
            return grouped_mm_available(x)
        return self.use_grouped_mm and grouped_mm_supported(x)

    def static_token_path(self, x: torch.Tensor) -> bool:
        """Whether ``compute`` on tokens like ``x`` (in the compute dtype) reads nothing on the
        host: the grouped GEMM (the per-expert loop reads the counts). What lets compile take
        the MoE layer with its block (parallel/compile.py)."""
        return self.grouped(x) and _fits_grouped_mm(x, self.w1)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _fits_grouped_mm(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """The grouped GEMM wants every row stride a multiple of 16 bytes (dim and hidden_dim)."""
    return all(n * x.element_size() % 16 == 0 for n in w1.shape[1:])


def _looped_swiglu(x, counts, w1, w2, w3, biases=None, gated=None) -> torch.Tensor:
    """The reference: one SwiGLU per expert on its slice of rows (``counts`` read on the host);
    ``biases`` (b1, b2, b3) and ``gated`` (the activation of gate and up): ``GroupedExperts``'."""
    # unbind, not w1[e]: indexing in the loop makes autograd build (and zero-fill) a gradient of the
    # whole stacked weight once per expert (on CPU 30 of 38 s of a debug MoE model's steps); the
    # gradients are the same, unbind's backward stacks them once.
    sizes = counts.tolist()
    tail = x.shape[0] - sum(sizes)
    parts = torch.split(x, sizes + [tail] if tail else sizes, dim=0)
    if gated is not None:
        zeros = [x.new_zeros(w1.shape[0], n) for n in (w1.shape[1], w2.shape[1], w3.shape[1])]
        b1, b2, b3 = (b.unbind(0) for b in (biases or zeros))
        outs = [gated(part @ a.T + d, part @ c.T + f) @ b.T + e
                for part, a, b, c, d, e, f in zip(parts, w1.unbind(0), w2.unbind(0), w3.unbind(0), b1, b2, b3)]
    else:
        outs = [(F.silu(part @ a.T) * (part @ c.T)) @ b.T
                for part, a, b, c in zip(parts, w1.unbind(0), w2.unbind(0), w3.unbind(0))]
    if tail:
        outs.append(x.new_zeros(tail, w2.shape[1]))
    return torch.cat(outs, dim=0) if outs else x.new_zeros(x.shape)


def _grouped_swiglu(x, counts, w1, w2, w3, align: int = 1, biases=None, gated=None) -> torch.Tensor:
    """Every expert's SwiGLU in three grouped GEMMs over ``pad_groups``' layout (no host read);
    ``biases`` and ``gated`` as ``_looped_swiglu``'s (each row adds its expert's biases)."""
    layout = pad_groups(counts, x.shape[0], align)
    padded = x if layout.source is None else torch.cat([x, x.new_zeros(1, x.shape[-1])])[layout.source]
    if gated is None:
        h = F.silu(torch._grouped_mm(padded, w1.transpose(-2, -1), offs=layout.ends))
        h = h * torch._grouped_mm(padded, w3.transpose(-2, -1), offs=layout.ends)
        out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=layout.ends).type_as(x)
        return out if layout.position is None else out[layout.position]
    gate = torch._grouped_mm(padded, w1.transpose(-2, -1), offs=layout.ends)
    up = torch._grouped_mm(padded, w3.transpose(-2, -1), offs=layout.ends)
    if biases is not None:  # each padded row's expert, from the group ends (on the device)
        expert = torch.searchsorted(layout.ends, torch.arange(padded.shape[0], device=x.device, dtype=torch.int32),
                                    right=True).clamp_(max=w1.shape[0] - 1)
        gate, up = gate + biases[0][expert], up + biases[2][expert]
    out = torch._grouped_mm(gated(gate, up), w2.transpose(-2, -1), offs=layout.ends)
    if biases is not None:
        out = out + biases[1][expert]
    out = out.type_as(x)
    return out if layout.position is None else out[layout.position]


class MoE(nn.Module):
    """Routed experts plus optional shared experts; input and output [B, S, dim]."""

    moe_layer = True  # for parallel/: expert tensor parallelism sets ``etp``; compile leaves it eager

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = TokenChoiceTopKRouter(dim, args.num_experts, args.top_k, args.score_func,
                                            args.route_norm, args.route_scale, args.num_groups, args.top_k_groups,
                                            bias=args.router_bias)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts, use_grouped_mm=args.use_grouped_mm,
                                      token_group_align=args.token_group_align, biases=args.expert_biases,
                                      activation=args.activation, swiglu_alpha=args.swiglu_alpha,
                                      swiglu_limit=args.swiglu_limit)
        # Registered even when absent (a None slot), so plans naming it skip it instead of failing.
        self.register_module("shared_experts", FeedForward(dim, args.hidden_dim * args.num_shared_experts)
                             if args.num_shared_experts else None)
        self.load_balance_coeff = args.load_balance_coeff
        # Set by expert tensor parallelism (parallel/expert.py, tp > 1 with ep = 1).
        self.etp = None
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32),
                             persistent=args.load_balance_coeff is not None)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32),
                             persistent=False)

    def reset_buffers(self) -> None:
        """Zero the bias and the counts, in fp32 (after ``to_empty``, which leaves them undefined,
        or a cast of the whole model to bf16, which would round the bias updates away)."""
        device = self.expert_bias.device
        self.expert_bias = torch.zeros(self.args.num_experts, dtype=torch.float32, device=device)
        self.tokens_per_expert = torch.zeros(self.args.num_experts, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        bias = self.expert_bias if self.load_balance_coeff is not None else None
        scores, experts, counts = self.router(tokens, bias)
        if torch.is_grad_enabled():
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        if self.etp is None:
            routed = self.route(tokens, scores, experts, counts)
        else:  # tensor-parallel experts: every TP rank computes its slice of every rank's tokens
            routed = self.etp.scatter(self.route(*self.etp.gather(tokens, scores, experts)))
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(tokens)
        return routed.reshape(shape)

    def route(self, tokens: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor,
              counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each token through its top-k experts, weighted by its scores: [T, dim] -> [T, dim]."""
        if counts is None:
            counts = routed_counts(experts, self.args.num_experts)
        k = scores.shape[-1]
        order = torch.argsort(experts.flatten(), stable=True)  # (token, slot) pairs sorted by expert
        routed = tokens[order // k]
        if self.args.score_before_experts:
            routed = (routed.float() * scores.flatten()[order, None]).to(routed.dtype)
        out = self.experts(routed, counts)
        # Back to (token, slot) order, then a fixed-order weighted sum over the k slots.
        unsorted = torch.empty_like(out).index_copy_(0, order, out).view(-1, k, tokens.shape[-1])
        if self.args.score_before_experts:
            return unsorted.sum(dim=1)
        return (unsorted.float() * scores[..., None]).sum(dim=1).to(out.dtype)


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: Optional[dist.ProcessGroup] = None, *, reduce: bool = True) -> None:
    """After an optimizer step: move every MoE's ``expert_bias`` toward balance, reset the counts.

    The counts are summed over ``group`` (every rank whose tokens these experts saw) first, so
    the bias stays identical on all ranks; ``reduce=False``: this rank alone saw them. ``delta = coeff * sign(mean - count)``, centred.
    """
    layers = [m for m in moe_modules(model) if m.load_balance_coeff is not None]
    if not layers:
        return
    counts = torch.stack([m.tokens_per_expert for m in layers])
    if reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    for layer, count in zip(layers, counts):
        delta = layer.load_balance_coeff * torch.sign(count.mean() - count)
        layer.expert_bias += delta - delta.mean()
        layer.tokens_per_expert.zero_()


def reset_moe_buffers(model: nn.Module) -> None:
    for layer in moe_modules(model):
        layer.reset_buffers()
