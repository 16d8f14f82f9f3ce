"""Functions run on each thread rank by test_expert_parallel.py (titan_lightning.testing.threaded)."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from titan_lightning.models.common.moe import MoE, MoEArgs
from titan_lightning.parallel.expert import apply_expert_parallel


def make_moe(seed: int = 0, dtype: torch.dtype = torch.float64, **fields) -> MoE:
    moe = MoE(16, MoEArgs(**{"num_experts": 8, "top_k": 2, "hidden_dim": 8, "num_shared_experts": 1, **fields}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    moe.reset_buffers()
    return moe.to(dtype)


def tokens_of(rank: int, batch: int = 2, seq: int = 6, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Different tokens on every rank (data parallel), skewed so expert loads are uneven."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(batch, seq, 16, generator=g, dtype=torch.float64)
    return (x + torch.linspace(0, 1.5 * rank, 16, dtype=torch.float64)).to(dtype)


def ep_matches_one_process(rank: int, world_size: int, dispatch: str = "splits", dtype: torch.dtype = torch.float64,
                           guard=None, **fields) -> dict:
    """This rank's MoE output and the summed weight gradients under EP vs every rank's tokens in one
    MoE (``guard``: a context the EP forward and backward run in)."""
    from contextlib import nullcontext

    reference = make_moe(dtype=dtype, **fields)
    moe = make_moe(dtype=dtype, **fields)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    apply_expert_parallel(moe, mesh, dispatch)
    x = tokens_of(rank, dtype=dtype).requires_grad_()
    with guard() if guard is not None else nullcontext():
        out = moe(x)
        (out * torch.cos(x)).sum().backward()
    # The one-process run over all ranks' tokens; the EP gradient of a shared weight is this
    # rank's part only, so sum it over the ranks before comparing.
    everything = torch.cat([tokens_of(r, dtype=dtype) for r in range(world_size)]).requires_grad_()
    expected = reference(everything)
    (expected * torch.cos(everything)).sum().backward()
    gate = moe.router.gate.weight.grad.clone()
    dist.all_reduce(gate)
    w1 = moe.experts.w1.grad.full_tensor()  # each rank's experts' gradients, all ranks' tokens in them
    counts = [int(c) for c in moe.experts.w1.to_local().shape[:1]]
    return {
        "out": (out - expected[rank * 2:(rank + 1) * 2]).abs().max().item(),
        "dx": (x.grad - everything.grad[rank * 2:(rank + 1) * 2]).abs().max().item(),
        "gate": (gate - reference.router.gate.weight.grad).abs().max().item(),
        "w1": (w1 - reference.experts.w1.grad).abs().max().item(),
        "local_experts": counts[0],
        "tokens_per_expert": moe.tokens_per_expert.tolist(),
    }


def round_trip(rank: int, world_size: int, dispatch: str = "splits") -> dict:
    """Dispatch then combine with identity experts: the tokens come back unchanged and in order."""
    from titan_lightning.parallel.expert import ExpertParallel

    class Identity:
        seen = None

        def compute(self, x, counts):
            Identity.seen = (int(counts.sum()), counts.tolist())
            return x

    n_experts = 2 * world_size
    if dispatch == "splits":
        counts = torch.tensor([(rank + 1) * (e % 3) for e in range(n_experts)])  # uneven, some zero
    else:  # padded blocks need as many rows on every rank: the same counts, rotated
        counts = torch.tensor([3 * ((e + rank) % 3) for e in range(n_experts)])
    x = torch.arange(int(counts.sum()) * 3, dtype=torch.float64).view(-1, 3) + 1000 * rank
    ep = ExpertParallel(group=dist.group.WORLD, rank=rank, size=world_size, dispatch=dispatch)
    out = ep.run(Identity(), x, counts)
    return {"equal": torch.equal(out, x), "received": Identity.seen}
