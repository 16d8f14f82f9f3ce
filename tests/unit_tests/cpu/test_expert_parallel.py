"""Expert parallelism: dispatch/combine against the unsharded MoE, on thread ranks with real exchange."""

import pytest
import torch

from ep_cases import ep_matches_one_process
from titan_lightning.parallel.expert import _expert_major_order
from titan_lightning.testing.threaded import run_threaded


def test_expert_major_order_regroups_rank_major_rows():
    # 2 ranks x 2 local experts; rows arrive (rank0: e0 x1, e1 x2), (rank1: e0 x0, e1 x3)
    order = _expert_major_order([[1, 2], [0, 3]], torch.device("cpu"))
    assert order.tolist() == [0, 1, 2, 3, 4, 5]
    order = _expert_major_order([[2, 1], [1, 2]], torch.device("cpu"))
    assert order.tolist() == [0, 1, 3, 2, 4, 5]  # e0: r0 rows 0-1, r1 row 3; e1: r0 row 2, r1 rows 4-5


@pytest.mark.parametrize("ep, fields", [(2, {}), (4, {}), (2, dict(top_k=3, score_before_experts=True)),
                                        (4, dict(score_func="sigmoid", route_norm=True, num_shared_experts=0))])
def test_ep_output_and_gradients_equal_the_unsharded_moe(ep, fields):
    for rank, errors in enumerate(run_threaded(ep_matches_one_process, ep, **fields)):
        assert errors["local_experts"] == 8 // ep
        for name in ("out", "dx", "gate", "w1"):
            assert errors[name] < 1e-12, f"rank {rank}: {name} differs by {errors[name]:.2e}"


def test_dispatch_then_combine_is_the_identity_for_uneven_counts():
    from ep_cases import round_trip

    results = run_threaded(round_trip, 3)
    assert all(r["equal"] for r in results)
    # rank 1 holds experts 2, 3 and gets (r + 1) * (e % 3) tokens for each from every rank r
    assert results[1]["received"] == (sum((r + 1) * (2 + 0) for r in range(3)), [6 * 2, 0])
