"""Mixture of experts: a token-choice top-k router, grouped SwiGLU experts, shared experts,
and auxiliary-loss-free load balancing.

    x [B, S, dim] -> tokens [T, dim]
    router:   scores [T, E] (softmax or sigmoid of gate(x)); the top_k experts of each token,
              picked on scores + expert_bias (the bias steers selection only); with expert
              groups, only from the token's top_k_groups best groups (DeepSeek V3)
    experts:  the T * top_k (token, expert) pairs sorted by expert, one SwiGLU per expert
              (``torch._grouped_mm`` on GPUs that have it, an exact per-expert loop elsewhere)
    combine:  each token's top_k outputs weighted by their scores and summed, in a fixed
              order (no atomic adds: deterministic), plus the shared experts' output

Expert weights are stacked: ``w1``/``w3`` [E, hidden, dim], ``w2`` [E, dim, hidden] (each
slice is a Hugging Face per-expert ``Linear.weight``). Expert parallelism sets
``GroupedExperts.ep``; it then receives this rank's sorted tokens with the per-expert
counts over all experts and exchanges them with the ranks that hold those experts.
Expert tensor parallelism (tp > 1, ep = 1) sets ``MoE.etp``: the experts' hidden dim is
split over the TP ranks, which gather each other's routed tokens (parallel/expert.py).

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

SCORE_FUNCS = ("softmax", "sigmoid")

# Tensor-parallel plan entries for MoE layers at ``layers.*.moe`` (parallel/tensor.py styles):
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

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_dim", "num_groups", "top_k_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"moe.{name}={value!r} must be a positive integer")
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k={self.top_k} must be <= moe.num_experts={self.num_experts}")
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
                 route_norm: bool = False, route_scale: float = 1.0, num_groups: int = 1, top_k_groups: int = 1):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
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
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts)
        return top_scores, experts, counts

    def in_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` [T, E] with -inf for every expert outside the token's ``top_k_groups`` best groups."""
        groups = choice.unflatten(-1, (self.num_groups, -1))  # [T, G, E / G]
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        best = torch.topk(group_scores, self.top_k_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
        return groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs bf16 on Hopper-class GPUs and newer."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


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
    """``num_experts`` SwiGLU experts in stacked weights; tokens arrive sorted by expert."""

    routed_experts = True  # what expert parallelism shards (parallel/expert.py)

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        # Set by expert parallelism (parallel/expert.py): dispatch, compute locally, combine.
        self.ep = None
        # Factor on the weights' gradients (set with expert FSDP: parallel/fsdp.py).
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim] sorted by expert, ``counts`` [num_experts] tokens per expert -> [N, dim]."""
        if self.ep is not None:
            return self.ep.run(self, x, counts)
        return self.compute(x, counts)

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's expert weights as plain tensors in ``dtype`` (the local shard under EP)."""
        weights = [_local(w).to(dtype) for w in (self.w1, self.w2, self.w3)]
        if self.grad_scale != 1.0:
            weights = [_ScaleGrad.apply(w, self.grad_scale) for w in weights]
        return tuple(weights)

    def compute(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The local experts on their tokens (``counts`` over the local experts).

        Under autocast the experts compute in autocast's dtype, as its matmuls would: the
        grouped GEMM is not on autocast's list, and fp32 inputs would send a bf16 run down
        the per-expert loop (one host sync and 3 x experts small matmuls per layer)."""
        x = x.to(_compute_dtype(x))
        w1, w2, w3 = self.weights(x.dtype)
        if grouped_mm_available(x):
            return _grouped_swiglu(x, counts, w1, w2, w3)
        return _looped_swiglu(x, counts, w1, w2, w3)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _looped_swiglu(x, counts, w1, w2, w3) -> torch.Tensor:
    # unbind, not w1[e]: indexing in the loop makes autograd build (and zero-fill) a gradient of the
    # whole stacked weight once per expert (on CPU 30 of 38 s of a debug MoE model's steps); the
    # gradients are the same, unbind's backward stacks them once.
    outs = []
    for part, a, b, c in zip(torch.split(x, counts.tolist(), dim=0), w1.unbind(0), w2.unbind(0), w3.unbind(0)):
        outs.append((F.silu(part @ a.T) * (part @ c.T)) @ b.T)
    return torch.cat(outs, dim=0) if outs else x.new_zeros(x.shape)


def _grouped_swiglu(x, counts, w1, w2, w3) -> torch.Tensor:
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets).type_as(x)


class MoE(nn.Module):
    """Routed experts plus optional shared experts; input and output [B, S, dim]."""

    moe_layer = True  # for parallel/: expert tensor parallelism sets ``etp``; compile leaves it eager

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = TokenChoiceTopKRouter(dim, args.num_experts, args.top_k, args.score_func,
                                            args.route_norm, args.route_scale, args.num_groups, args.top_k_groups)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts)
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
            counts = torch.bincount(experts.flatten(), minlength=self.args.num_experts)
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
