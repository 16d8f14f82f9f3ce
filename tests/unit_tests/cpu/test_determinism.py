"""Seeds per rank (same on SPMD ranks, distinct per pipeline stage) and deterministic mode."""

import random

import numpy as np
import torch

from titan_lightning.parallel.determinism import set_determinism, stage_seed


def test_spmd_ranks_share_the_seed_and_pipeline_stages_get_their_own():
    assert stage_seed(7) == stage_seed(7, pp_rank=0, pp=1) == 7
    assert [stage_seed(7, pp_rank=r, pp=4) for r in range(4)] == [7, 8, 9, 10]


def test_deterministic_mode_fixes_threads_and_seeds_then_restores():
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    state = set_determinism(3, deterministic=True, device_type="cpu", pp_rank=1, pp=2)
    try:
        assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
        drawn = (torch.rand(2).tolist(), random.random(), np.random.rand())
        set_determinism(3, deterministic=True, device_type="cpu", pp_rank=1, pp=2)
        assert (torch.rand(2).tolist(), random.random(), np.random.rand()) == drawn  # seed 4 again
        set_determinism(3, deterministic=True, device_type="cpu", pp_rank=0, pp=2)
        assert torch.rand(2).tolist() != drawn[0]  # another stage, another stream
    finally:
        state.restore()
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == before


def test_cpu_threads_is_honoured_and_non_deterministic_mode_leaves_threads_alone():
    threads = torch.get_num_threads()
    state = set_determinism(0, deterministic=False, device_type="cpu")
    assert torch.get_num_threads() == threads
    state.restore()
    state = set_determinism(0, deterministic=True, device_type="cpu", cpu_threads=2)
    assert torch.get_num_threads() == 2
    state.restore()
    assert torch.get_num_threads() == threads
