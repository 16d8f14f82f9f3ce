"""The global gradient norm's compiled float64 reduction (parallel/grad_norm.py): the same norm as
aten's cast-then-reduce, on plain tensors and on DTensors sharded or replicated over threaded
ranks. (CUDA takes it; the CPU keeps aten's kernels, so here the tests point it at the CPU.)"""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from titan_lightning.parallel import grad_norm
from titan_lightning.parallel.grad_norm import fused_square_sum_applies, global_grad_norm
from titan_lightning.testing.threaded import run_threaded

SHAPES = [(64, 256), (1000,), (3, 5, 7), (0,), (1,), (513, 257), (300, 1000), (70000,)]


def _grads(dtype=torch.float32):
    torch.manual_seed(0)
    return [(torch.randn(s) * 10.0 ** (i % 4 - 1)).to(dtype) for i, s in enumerate(SHAPES)]


def _fused(monkeypatch, backend="aot_eager"):
    monkeypatch.setattr(grad_norm, "FUSED_SQUARE_SUM_DEVICES", ("cpu",))
    monkeypatch.setattr(grad_norm, "FUSED_SQUARE_SUM_BACKEND", backend)


def test_the_cpu_keeps_atens_kernels_by_default():
    assert not fused_square_sum_applies(torch.zeros(3))  # the golden files hold aten's bits


@pytest.mark.parametrize("backend", ["aot_eager"])  # inductor: tests/unit_tests/gpu/test_grad_norm_gpu.py
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_reduction_equals_atens_float64_norm(monkeypatch, backend, dtype):
    grads = _grads(dtype)
    reference = global_grad_norm(grads)
    _fused(monkeypatch, backend)
    assert all(fused_square_sum_applies(g) for g in grads)
    fused = global_grad_norm(grads)
    assert fused.dtype == torch.float32
    # Both accumulate in float64 (in different orders) and round to float32: the same float.
    assert fused.item() == reference.item()
    exact = torch.cat([g.double().flatten() for g in grads]).square().sum().sqrt()
    assert grad_norm._fused_norm(grads).item() == pytest.approx(exact.item(), rel=1e-13)


def _dtensor_norms(rank, world_size, full, mesh_shape, placements):
    mesh = init_device_mesh("cpu", mesh_shape)
    grads = [distribute_tensor(g, mesh, p) for g, p in zip(full, placements)]
    assert all(fused_square_sum_applies(g) for g in grads)
    return global_grad_norm(grads).item(), grad_norm._fused_norm(grads).item()


@pytest.mark.parametrize("mesh_shape,placements", [
    ((2,), [[Shard(0)], [Replicate()], [Shard(0)], [Replicate()], [Replicate()], [Shard(1)], [Shard(0)], [Shard(0)]]),
    ((2, 2), [[Shard(0), Replicate()], [Replicate(), Shard(0)], [Shard(0), Shard(1)], [Replicate(), Replicate()],
              [Replicate(), Replicate()], [Shard(1), Shard(0)], [Shard(0), Replicate()], [Replicate(), Shard(0)]]),
], ids=["fsdp2", "2d"])
def test_dtensor_shards_sum_over_their_mesh_dims_once(monkeypatch, mesh_shape, placements):
    monkeypatch.setattr(grad_norm, "FUSED_SQUARE_SUM_DEVICES", ("cpu",))
    # Eager sums: dynamo compiling from several threads at once is not supported; what is
    # checked here is how the ranks' sums combine.
    monkeypatch.setattr(grad_norm, "square_sum", lambda t: t.double().square().sum())
    world = 1
    for n in mesh_shape:
        world *= n
    full = _grads()  # made once: the thread ranks share torch's random generator
    results = run_threaded(_dtensor_norms, world, timeout=120, full=full, mesh_shape=mesh_shape, placements=placements)
    exact = torch.cat([g.double().flatten() for g in full]).square().sum().sqrt()
    for fused, fused64 in results:
        assert fused == exact.float().item()  # the float32 norm every rank clips with
        assert fused64 == pytest.approx(exact.item(), rel=1e-13)  # replicated parts counted once, shards all


def test_a_compiler_failure_falls_back_to_atens_norm_with_a_warning(monkeypatch):
    grads = _grads()
    reference = global_grad_norm(grads)
    _fused(monkeypatch)

    def broken(backend):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(grad_norm, "_square_sum_fn", broken)
    with pytest.warns(UserWarning, match="compiled reduction failed .*no compiler here"):
        assert global_grad_norm(grads).item() == reference.item()
    assert grad_norm.FUSED_SQUARE_SUM_DEVICES == ()  # not tried again


def test_small_gradients_are_read_in_one_flat_piece_per_dtype(monkeypatch):
    """Many small gradients (LoRA's adapters) cost one compiled call per dtype, not one each (each
    call's host time is fixed); a large one is read in place; a piece holds at most PACKED_MAX_NUMEL."""
    _fused(monkeypatch)
    calls = []
    original = grad_norm.square_sum
    monkeypatch.setattr(grad_norm, "square_sum", lambda t: calls.append(t.numel()) or original(t))
    monkeypatch.setattr(grad_norm, "PACKED_BELOW_NUMEL", 50_000)
    monkeypatch.setattr(grad_norm, "PACKED_MAX_NUMEL", 400_000)
    torch.manual_seed(0)
    grads = [torch.randn(16, 640) for _ in range(60)] + [torch.randn(70_000)] + [torch.randn(640, 16).bfloat16()]
    exact = torch.cat([g.double().flatten() for g in grads]).square().sum().sqrt()
    assert grad_norm._fused_norm(grads).item() == pytest.approx(exact.item(), rel=1e-13)
    assert sorted(calls) == sorted([70_000, 39 * 10_240, 21 * 10_240, 10_240])  # alone; two fp32 pieces; bf16
