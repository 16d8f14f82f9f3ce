"""Context parallelism: sequence slicing and the three attention backends against full causal attention."""

import os
from pathlib import Path

import pytest
import torch

from titan_lightning.parallel.context import shard_positions
from titan_lightning.testing.spawn import run_function

CASES_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}


def test_headtail_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    assert shard_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([shard_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))  # a partition of the sequence
    assert shard_positions(8, 2, 1, None).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"sequence length 12 must be divisible by 2 \* cp = 8 for headtail"):
        shard_positions(12, 4, 0)
    with pytest.raises(ValueError, match=r"cp_load_balancer='ptrr': this attention supports 'headtail' or None"):
        shard_positions(16, 2, 0, "ptrr")


# (backend, load balancer, cp, n_heads, n_kv_heads)
PARITY = [
    ("allgather", "headtail", 2, 4, 2),
    ("allgather", "headtail", 4, 4, 4),
    ("allgather", None, 4, 4, 1),
    ("ring", "headtail", 2, 4, 2),
    ("ring", "headtail", 4, 4, 4),
    ("ring", None, 3, 2, 1),
    ("ulysses", "headtail", 2, 4, 2),
    ("ulysses", "headtail", 4, 8, 4),
    ("ulysses", None, 2, 2, 2),
]


@pytest.mark.multi_process
@pytest.mark.parametrize("backend, balancer, cp, heads, kv_heads", PARITY,
                         ids=[f"{b}-{lb}-cp{c}-h{h}kv{kv}" for b, lb, c, h, kv in PARITY])
def test_attention_matches_full_causal_attention_in_fp64(backend, balancer, cp, heads, kv_heads, tmp_path):
    results = run_function("cp_cases:attention_parity", cp, out_dir=tmp_path, timeout=180, env=CASES_ENV,
                           backend=backend, load_balancer=balancer, n_heads=heads, n_kv_heads=kv_heads,
                           seq_len=24 if cp == 3 else 32)
    for rank, errors in enumerate(results):
        for name in ("out", "dq", "dk", "dv"):
            assert errors[name] < 1e-10, f"rank {rank}: {name} differs by {errors[name]:.2e}"
