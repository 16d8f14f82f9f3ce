"""The routed experts without host reads: the device-side padded layout, the grouped GEMM against
the per-expert loop, padding that never changes a result, and a guard that fails on a host sync.

The grouped GEMM runs here through torch's CPU kernel (``use_grouped_mm=True``); the layout code
(``pad_groups``) is the one a GPU runs. fp32 results agree to ``TOLERANCE`` of each tensor's
largest element (absolute where that is below 1), not bitwise: the CPU's vectorized elementwise kernels (SiLU) round the last elements of a
tensor, or of a thread's share of it, another way, so moving rows moves a few last bits."""

import pytest
import torch
import torch.nn.functional as F

from test_moe import _moe  # 8 experts, top-3, hidden 16, dim 32, seeded weights
from titan_lightning.models.common import moe as moe_module
from titan_lightning.models.common.moe import MoE, MoEArgs, count_tokens, pad_groups
from titan_lightning.testing.host_sync import HostSyncError, forbid_host_sync

pytestmark = pytest.mark.skipif(not moe_module.CPU_GROUPED_MM, reason="this torch has no CPU grouped GEMM")

E, DIM, HIDDEN = 8, 32, 16
# A weight gradient sums a few dozen tokens' products, each carrying such a last-bit difference:
# up to 1.4e-6 of the largest element seen here (DeepSeek's layer, one expert taking every token).
TOLERANCE = 2e-6


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * 0.2).requires_grad_()
            for shape in ((E, HIDDEN, DIM), (E, DIM, HIDDEN), (E, HIDDEN, DIM))]


def _assert_close(expected, actual, what: str) -> None:
    error = (actual - expected).abs().max() / expected.abs().max().clamp(min=1)
    assert error <= TOLERANCE, f"{what} differs by {error:.2e} of its largest element"


def _experts(fn, x, counts, weights, **kwargs):
    """Output and the gradients of x and of the three weights under a fixed upstream gradient."""
    x = x.detach().requires_grad_()
    out = fn(x, counts, *weights, **kwargs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return [out, *torch.autograd.grad(out, [x, *weights], upstream)]


ROUTINGS = {
    "random": [5, 0, 17, 3, 0, 9, 1, 12],
    "empty_experts": [0, 0, 0, 30, 0, 0, 17, 0],
    "all_on_the_first": [47, 0, 0, 0, 0, 0, 0, 0],
    "all_on_the_last": [0, 0, 0, 0, 0, 0, 0, 47],
    "one_row_each": [1] * E,
}


@pytest.mark.parametrize("align", [1, 8, 128])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_grouped_gemm_over_padded_groups_equals_the_per_expert_loop(routing, align):
    counts = torch.tensor(ROUTINGS[routing])
    x = torch.randn(int(counts.sum()), DIM, generator=torch.Generator().manual_seed(1))
    weights = _weights()
    loop = _experts(moe_module._looped_swiglu, x, counts, weights)
    grouped = _experts(moe_module._grouped_swiglu, x, counts, weights, align=align)
    for name, a, b in zip(("out", "dx", "dw1", "dw2", "dw3"), loop, grouped):
        _assert_close(a, b, f"{routing}, align {align}: {name}")


def test_trailing_zero_rows_join_no_expert_in_either_kernel():
    """Expert parallelism's empty slots: rows past sum(counts), zeros in, zeros out, no gradient."""
    counts = torch.tensor([3, 0, 2, 0, 0, 0, 0, 1])
    x = torch.cat([torch.randn(6, DIM, generator=torch.Generator().manual_seed(2)), torch.zeros(5, DIM)])
    weights = _weights()
    for fn, kwargs in ((moe_module._looped_swiglu, {}), (moe_module._grouped_swiglu, dict(align=8))):
        out, dx, *dw = _experts(fn, x, counts, weights, **kwargs)
        assert out.shape == x.shape and torch.equal(out[6:], torch.zeros(5, DIM))
        alone = _experts(fn, x[:6], counts, weights, **kwargs)
        for i, (a, b) in enumerate(zip([alone[0], *alone[2:]], [out[:6], *dw])):
            _assert_close(a, b, f"{fn.__name__}: tensor {i}")


def test_pad_groups_places_each_expert_on_a_multiple_of_the_alignment():
    # groups of 2, 0 and 3 rows plus one trailing row (joins the last group), aligned to 4
    layout = pad_groups(torch.tensor([2, 0, 3]), rows=6, align=4)
    pad = 6  # the zero row appended to the input
    assert layout.source.tolist() == [0, 1, pad, pad, 2, 3, 4, 5] + [pad] * 7  # 6 + 3 * 3 rows
    assert layout.position.tolist() == [0, 1, 4, 5, 6, 7]
    assert layout.ends.tolist() == [4, 4, 15] and layout.ends.dtype == torch.int32  # the last takes the rest
    plain = pad_groups(torch.tensor([2, 0, 3]), rows=5, align=1)
    assert plain.source is None and plain.position is None and plain.ends.tolist() == [2, 2, 5]


def _train_step(moe: MoE, favour: int = None):
    """Output and every gradient of one forward/backward (``favour``: an expert every token picks)."""
    if favour is not None:
        moe.expert_bias[favour] = 100.0  # the bias steers the choice only
    x = torch.randn(2, 24, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = moe(x)
    (out * torch.cos(out)).sum().backward()
    return [out, x.grad] + [p.grad for p in moe.parameters()]


LAYERS = {
    "qwen3": dict(),
    "deepseek_v3": dict(score_func="sigmoid", route_norm=True, route_scale=2.5, num_shared_experts=2,
                        num_groups=4, top_k_groups=2),
    "scores_first": dict(score_before_experts=True, top_k=2),
}


@pytest.mark.parametrize("favour", [None, 0, E - 1])
@pytest.mark.parametrize("layer", LAYERS)
def test_moe_layer_on_the_grouped_gemm_equals_the_loop(layer, favour):
    loop = _train_step(_moe(use_grouped_mm=False, **LAYERS[layer]), favour)
    grouped = _train_step(_moe(use_grouped_mm=True, token_group_align=8, **LAYERS[layer]), favour)
    for i, (a, b) in enumerate(zip(loop, grouped)):
        _assert_close(a, b, f"tensor {i}")


@pytest.mark.parametrize("layer", LAYERS)
def test_padding_never_changes_outputs_or_gradients(layer):
    results = {align: _train_step(_moe(use_grouped_mm=True, token_group_align=align, **LAYERS[layer]))
               for align in (1, 2, 8, 16, 128)}
    for align, tensors in results.items():
        for i, (a, b) in enumerate(zip(results[1], tensors)):
            _assert_close(a, b, f"align {align}: tensor {i}")


@pytest.mark.parametrize("layer", LAYERS)
def test_the_grouped_moe_layer_never_reads_a_device_value_on_the_host(layer):
    moe = _moe(use_grouped_mm=True, token_group_align=8, **LAYERS[layer])
    x = torch.randn(2, 24, DIM, requires_grad=True)
    with forbid_host_sync():
        out = moe(x)
        out.sum().backward()
    assert moe.tokens_per_expert.sum() == 2 * 24 * moe.args.top_k


def test_the_grouped_moe_layer_compiles_as_one_graph_with_static_shapes():
    """No graph break, no data-dependent shape: what compiling the MoE layer needs (bf16: torch's
    grouped GEMM meta function takes bf16 only)."""
    moe = _moe(use_grouped_mm=True, token_group_align=8, **LAYERS["deepseek_v3"]).to(torch.bfloat16)
    moe.reset_buffers()
    x = torch.randn(2, 16, DIM, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True, dynamic=False)
    out = compiled(x.requires_grad_())
    out.float().sum().backward()
    assert torch.equal(out, moe(x.detach()))
    assert x.grad is not None and moe.experts.w1.grad is not None


def test_the_host_sync_guard_catches_the_loops_read_of_the_counts():
    moe = _moe(use_grouped_mm=False)
    with pytest.raises(HostSyncError, match=r"Tensor.tolist\(\)"), forbid_host_sync():
        moe(torch.randn(2, 4, DIM))


@pytest.mark.parametrize("read, what", [
    (lambda t: t.item(), r"Tensor.item\(\)"),
    (lambda t: int(t[0]), r"Tensor.__int__\(\)"),
    (lambda t: t.cpu(), r"Tensor.cpu\(\)"),
    (lambda t: t[t > 1], "boolean mask"),
    (lambda t: torch.nonzero(t), "nonzero"),
    (lambda t: torch.bincount(t), "bincount"),
    (lambda t: torch.split(torch.zeros(6), t.tolist()), r"Tensor.tolist\(\)"),
    (lambda t: torch.repeat_interleave(t), "repeat_interleave"),
])
def test_the_host_sync_guard_names_each_way_to_read_a_value(read, what):
    t = torch.tensor([1, 2, 3])
    with pytest.raises(HostSyncError, match=what), forbid_host_sync():
        read(t)
    assert t.tolist() == [1, 2, 3]  # restored on exit


def test_the_host_sync_guard_sees_the_one_read_left_in_exact_split_dispatch():
    """``parallelism.ep_dispatch="splits"`` reads the split sizes on the host, once per layer."""
    from ep_cases import ep_matches_one_process
    from titan_lightning.testing.threaded import run_threaded

    with pytest.raises(RuntimeError, match=r"HostSyncError.*Tensor.tolist\(\)"):
        run_threaded(ep_matches_one_process, 2, dispatch="splits", dtype=torch.float32, guard=forbid_host_sync,
                     use_grouped_mm=True)


def test_count_tokens_equals_bincount():
    experts = torch.randint(0, E, (40, 3), generator=torch.Generator().manual_seed(4))
    experts[:, 0] = 2  # skewed, some experts empty
    assert torch.equal(count_tokens(experts, E), torch.bincount(experts.flatten(), minlength=E))


def test_the_grouped_gemm_reaches_no_expert_parallel_host_read_under_padded_dispatch():
    """EP with padded all-to-all blocks, two thread ranks: no host read on either rank's token
    path, and the outputs and gradients equal the unsharded layer's."""
    from ep_cases import ep_matches_one_process
    from titan_lightning.testing.threaded import run_threaded

    results = run_threaded(ep_matches_one_process, 2, dispatch="padded", dtype=torch.float32,
                           guard=forbid_host_sync, use_grouped_mm=True, token_group_align=8)
    for rank, errors in enumerate(results):
        for name in ("out", "dx", "gate", "w1"):
            assert errors[name] < 1e-5, f"rank {rank}: {name} differs by {errors[name]:.2e}"


def test_bad_moe_kernel_settings_name_the_field():
    with pytest.raises(ValueError, match=r"moe.token_group_align=0 must be a positive integer \(e.g. 8, 16, 128\)"):
        MoEArgs(token_group_align=0)
    with pytest.raises(ValueError, match=r"moe.use_grouped_mm='yes' must be true, false or None"):
        MoEArgs(use_grouped_mm="yes")
