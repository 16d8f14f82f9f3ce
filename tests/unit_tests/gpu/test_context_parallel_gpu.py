"""Context-parallel attention on one GPU: CP ranks are threads (torch's threaded process group).

NCCL refuses two ranks on one device, so the ranks exchange real data through the threaded
group instead. fp64 checks exactness (SDPA's math kernel); bf16 runs with the math kernel
disabled, so the all-gather and Ulysses backends must find a flash or memory-efficient
kernel, and their error must stay within a small multiple of unsharded bf16 attention's.
"""

import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parents[1] / "cpu"))
from cp_cases import attention_parity, in_precision, make_inputs, references  # noqa: E402

from titan_lightning.testing.threaded import run_threaded  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [(b, lb, cp) for b in ("allgather", "ring", "ulysses") for lb, cp in (("headtail", 2), ("headtail", 4), (None, 2))]


def _on_cuda(rank, world_size, **kwargs):
    torch.cuda.set_device(0)
    return attention_parity(rank, world_size, device="cuda", **kwargs)


@pytest.mark.parametrize("backend, balancer, cp", CASES, ids=[f"{b}-{lb}-cp{c}" for b, lb, c in CASES])
def test_cp_attention_on_gpu_matches_full_attention_in_fp64(backend, balancer, cp):
    results = run_threaded(_on_cuda, cp, backend=backend, load_balancer=balancer, n_heads=8, n_kv_heads=4,
                           seq_len=64, head_dim=32)
    for rank, errors in enumerate(results):
        for name in ("out", "dq", "dk", "dv"):
            assert errors[name] < 1e-10, f"rank {rank}: {name} differs by {errors[name]:.2e}"




@pytest.mark.parametrize("backend, balancer, cp", CASES, ids=[f"{b}-{lb}-cp{c}" for b, lb, c in CASES])
def test_cp_attention_on_gpu_in_bf16_with_fast_kernels_is_as_close_as_unsharded_bf16(backend, balancer, cp):
    shape = dict(n_heads=8, n_kv_heads=4, seq_len=1024, head_dim=64)
    inputs = make_inputs(**shape, device="cuda")
    refs = references(inputs)  # fp64: SDPA's math kernel, so before it is switched off
    # The kernel choice is process-global: set here, for every thread rank at once.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        refs["low"] = in_precision(inputs, "bfloat16")
        results = run_threaded(_on_cuda, cp, backend=backend, load_balancer=balancer, dtype="bfloat16",
                               precomputed=refs, **shape)
    worst = {name: max(e[name] for e in results) for name in ("out", "dq", "dk", "dv")}
    print(f"\n{backend} {balancer} cp{cp} bf16 max errors: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    for rank, errors in enumerate(results):
        for name in ("out", "dq", "dk", "dv"):
            bound = 4 * errors[f"baseline_{name}"] + 1e-3 * errors["scale"]
            assert errors[name] <= bound, (
                f"rank {rank}: bf16 {name} error {errors[name]:.2e} > {bound:.2e} "
                f"(unsharded bf16: {errors[f'baseline_{name}']:.2e})")
