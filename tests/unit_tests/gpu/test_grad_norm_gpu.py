"""The gradient norm's compiled float64 reduction on a GPU (the path CUDA takes) against aten's
cast-then-reduce, and the bytes it saves."""

import pytest
import torch

from titan_lightning.parallel import grad_norm
from titan_lightning.parallel.grad_norm import fused_square_sum_applies, global_grad_norm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_reduction_equals_atens_float64_norm_on_the_gpu(monkeypatch, dtype):
    torch.manual_seed(0)
    shapes = [(4096, 4096), (128, 768, 2048), (151936, 64), (1000,), (1,), (0,), (70000,)]
    grads = [(torch.randn(s, device="cuda") * 10.0 ** (i % 4 - 1)).to(dtype) for i, s in enumerate(shapes)]
    assert all(fused_square_sum_applies(g) for g in grads)
    fused, fused64 = global_grad_norm(grads), grad_norm._fused_norm(grads)
    exact = torch.cat([g.double().flatten() for g in grads]).square().sum().sqrt()
    monkeypatch.setattr(grad_norm, "FUSED_SQUARE_SUM_DEVICES", ())
    reference = global_grad_norm(grads)
    assert fused64.item() == pytest.approx(exact.item(), rel=1e-12)
    assert fused.item() == pytest.approx(reference.item(), rel=1.2e-7)  # the same float32, or its neighbour


def test_compiled_reduction_moves_a_fraction_of_atens_bytes():
    g = torch.randn(64 * 1024 * 1024, device="cuda")
    for fused in (True, False):  # warm up both (the first call compiles)
        grad_norm.square_sum(g) if fused else torch.linalg.vector_norm(g, dtype=torch.float64)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grad_norm.square_sum(g)
    fused_extra = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    torch.linalg.vector_norm(g, dtype=torch.float64)
    aten_extra = torch.cuda.max_memory_allocated() - base
    assert aten_extra >= 8 * g.numel()  # aten's float64 copy of the whole gradient
    assert fused_extra < g.numel()  # the compiled reduction: partial sums only
