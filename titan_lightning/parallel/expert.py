"""Expert parallelism: the routed experts of every MoE layer sharded over the ``ep`` ranks.

Rank i of the ep group holds experts [i * E/ep, (i + 1) * E/ep) (the expert weights become
DTensors sharded on dim 0 over the ep mesh). In each MoE layer the router runs on the
rank's own tokens; then

    1. the per-expert token counts are exchanged (all-to-all), so every rank knows how many
       tokens it receives for each of its experts from each rank (uneven splits);
    2. the tokens, sorted by global expert, go to the ranks holding their experts
       (all-to-all with those splits), are regrouped by local expert and computed;
    3. the outputs take the reverse way (all-to-all) back into the original order.

Both token all-to-alls are autograd functions whose backward is the reverse exchange, so
gradients reach the tokens' own ranks and each expert's weights get the gradient of
exactly the tokens routed to it, from every rank.

Two ways to size the token all-to-alls (``parallelism.ep_dispatch``):

- ``splits`` (the default): the exact split sizes, read on the host after the counts'
  all-to-all: one host synchronization per MoE layer (forward; the backward reuses them),
  and each rank sends and receives only its real tokens.
- ``padded``: no host read. Every rank sends every rank a block of ``capacity`` rows, the
  worst case (all of its N = tokens * top_k pairs for that rank's experts), its tokens first
  and zero rows after; the receiver orders the rows by (local expert, source rank) with an
  ``argsort`` of device-side keys, the empty slots last (they join the last expert's group as
  zero rows: zero outputs, no gradient). Every shape is static; every rank of the group must
  route as many tokens (equal microbatches, as in every layout here). The cost is ``ep`` times the
  traffic and the receive buffer: ``ep * N * dim`` elements per layer instead of about N *
  dim, e.g. 8 x 8192 tokens x top-8 x 2048 x 2 bytes = 2 GiB at ep 8 for Qwen 3 30B-A3B's
  shape, which is why it is not the default. The result equals ``splits``' (same rows, same
  order into the experts; the grouped GEMM's last group gains zero rows).

With tensor parallelism and ep = 1 the experts are tensor-parallel instead (``ExpertTensorParallel``):
each TP rank holds a slice of every expert's hidden dim, gathers the routed tokens of the TP
group (under sequence parallelism each rank routes its own), computes its partial outputs
and reduce-scatters them back.

The ep ranks are taken from dp_shard x cp x tp (ep innermost); the experts are then
FSDP-sharded over the remaining ``efsdp = dp_shard * cp * tp / ep`` ranks (and replicated
over dp_replicate), while the dense layers shard over dp_shard x cp as usual.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from titan_lightning.config import ConfigError
from titan_lightning.config.validation import validate_expert_split
from titan_lightning.parallel.collectives import (all_gather, all_gather_autograd, all_to_all, all_to_all_autograd,
                                                  reduce_scatter_autograd)
from titan_lightning.parallel import value_free
from titan_lightning.parallel.contracts import ContractError, expert_modules, moe_layers


@dataclass
class ExpertParallel:
    """The ep group of one rank; ``run`` is what GroupedExperts calls under EP. ``dispatch``:
    ``parallelism.ep_dispatch`` (the module docstring)."""

    group: dist.ProcessGroup
    rank: int
    size: int
    dispatch: str = "splits"

    def run(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` [N, dim] sorted by global expert, ``counts`` [E] -> the experts' outputs, same order."""
        if self.dispatch == "padded":
            return self.run_padded(experts, x, counts)
        assumed = value_free.assumed()  # (while tensors hold no values: parallel/value_free.py)
        input_splits, matrix, local_counts = self.splits(counts) if assumed is None else assumed.ep_splits(self, counts)
        output_splits = [sum(row) for row in matrix]
        tokens = all_to_all_autograd(x, self.group, output_splits, input_splits)
        # Arrived grouped by (source rank, local expert); the experts want (local expert, source rank).
        order = _expert_major_order(matrix, x.device)
        out = experts.compute(tokens[order], local_counts)
        back = torch.empty_like(out).index_copy_(0, order, out)
        return all_to_all_autograd(back, self.group, input_splits, output_splits)

    def splits(self, counts: torch.Tensor) -> tuple[list[int], list[list[int]], torch.Tensor]:
        """From this rank's tokens per global expert: tokens sent to each rank, the matrix
        ``received[j][e]`` (rank j's tokens for my local expert e; exchanged with the other
        ranks and read on the host) and my local experts' token counts (on the device)."""
        n_local = counts.numel() // self.size
        received = all_to_all(counts.to(torch.int64), self.group).view(self.size, n_local)
        return counts.view(self.size, n_local).sum(dim=1).tolist(), received.tolist(), received.sum(dim=0)


    def run_padded(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``run`` with static sizes and no host read: fixed blocks of N rows to every rank."""
        rows, n_local = x.shape[0], counts.numel() // self.size
        capacity = rows  # worst case: all of this rank's pairs go to one rank's experts
        sent = counts.view(self.size, n_local).sum(dim=1)  # rows for each rank
        sent_starts = torch.cumsum(sent, dim=0) - sent
        slot = torch.arange(capacity, device=x.device)
        # block j, slot r: my sorted row sent_starts[j] + r, or the zero row (index rows) past sent[j]
        source = torch.where(slot < sent[:, None], sent_starts[:, None] + slot, rows)
        padded = torch.cat([x, x.new_zeros(1, x.shape[-1])])[source.flatten()]
        received = all_to_all(counts.to(torch.int64), self.group).view(self.size, n_local)
        tokens = all_to_all_autograd(padded, self.group)  # [size * capacity, dim], block j from rank j
        # The local expert of block j's slot r (n_local: an empty slot), then (expert, rank, slot) order.
        expert = torch.searchsorted(torch.cumsum(received, dim=1), slot.expand(self.size, capacity).contiguous(),
                                    right=True)
        order = torch.argsort((expert * (self.size * capacity)
                               + torch.arange(self.size * capacity, device=x.device).view(self.size, capacity)).flatten())
        out = experts.compute(tokens[order], received.sum(dim=0))
        back = all_to_all_autograd(torch.empty_like(out).index_copy_(0, order, out), self.group)
        # My sorted row i came back in block j (its expert's rank), slot i - sent_starts[j].
        row = torch.arange(rows, device=x.device)
        rank = torch.searchsorted(torch.cumsum(sent, dim=0), row, right=True)
        return back[rank * capacity + row - sent_starts[rank]]


def _expert_major_order(matrix: list[list[int]], device: torch.device) -> torch.Tensor:
    """Indices that reorder rows grouped (rank, expert) into (expert, rank) order."""
    starts, offset = [], 0
    for row in matrix:
        starts.append([])
        for count in row:
            starts[-1].append(offset)
            offset += count
    pieces = [torch.arange(starts[j][e], starts[j][e] + matrix[j][e], device=device)
              for e in range(len(matrix[0]) if matrix else 0) for j in range(len(matrix))]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)


def apply_expert_parallel(model: nn.Module, ep_mesh, dispatch: str = "splits") -> ExpertParallel:
    """Shard every MoE layer's routed experts over ``ep_mesh`` (dim 0) and route through it,
    the tokens' all-to-alls sized as ``dispatch`` says (``parallelism.ep_dispatch``, checked there)."""
    size = ep_mesh.size()
    modules = expert_modules(model, size)
    for module in modules:
        validate_expert_split(type(module).__name__, module.num_experts, None, ep=size, tp=1)
    context = ExpertParallel(group=ep_mesh.get_group(), rank=ep_mesh.get_local_rank(), size=size, dispatch=dispatch)
    for module in modules:
        for name, param in list(module.named_parameters()):  # (their LoRA factors too: lora/experts.py)
            owner, _, leaf = name.rpartition(".")
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            sharded = nn.Parameter(sharded, requires_grad=param.requires_grad)
            module.get_submodule(owner).register_parameter(leaf, sharded)
        module.ep = context
    return context


@dataclass
class ExpertTensorParallel:
    """The TP group of one rank when the experts are tensor-parallel (``MoE.etp``)."""

    group: dist.ProcessGroup
    size: int

    def gather(self, tokens: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor):
        """Every TP rank's routed tokens [T * tp, dim], their scores and experts (rank order)."""
        return (all_gather_autograd(tokens, 0, self.group), all_gather_autograd(scores, 0, self.group),
                all_gather(experts, 0, self.group))

    def scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """Partial outputs of all gathered tokens -> the summed outputs of this rank's tokens."""
        return reduce_scatter_autograd(partial, 0, self.group)


def apply_expert_tensor_parallel(model: nn.Module, tp_mesh) -> ExpertTensorParallel:
    """Split every MoE layer's routed experts over ``tp_mesh`` along their hidden dim."""
    layers, size = moe_layers(model), tp_mesh.size()
    if not layers:
        raise ContractError(f"expert tensor parallelism over tp={size}: {type(model).__name__} has no MoE layer")
    context = ExpertTensorParallel(group=tp_mesh.get_group(), size=size)
    for layer in layers:
        experts = layer.experts
        if getattr(experts, "b1", None) is not None:  # (the down bias would be added once per TP rank)
            raise ConfigError(f"parallelism.tp={size} with parallelism.ep=1: experts with biases (gpt-oss) are not "
                              f"tensor-parallel here; set parallelism.ep to a multiple of tp")
        validate_expert_split(type(experts).__name__, experts.w1.shape[0], experts.w1.shape[1], ep=1, tp=size)
        for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):  # w1/w3 [E, hidden, dim], w2 [E, dim, hidden]
            param = getattr(experts, name)
            sharded = distribute_tensor(param.data, tp_mesh, [Shard(dim)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        layer.etp = context
    return context
