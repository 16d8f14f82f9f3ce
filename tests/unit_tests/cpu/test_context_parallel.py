"""Context parallelism: sequence slicing and the three attention backends against full causal attention."""

from pathlib import Path

import pytest
import torch

from titan_lightning.parallel.context import shard_positions
from titan_lightning.testing.launch import pythonpath_env
from titan_lightning.testing.spawn import run_function

CASES_ENV = pythonpath_env(Path(__file__).parent)


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


# -- configuration: transforms and validation ----------------------------------------------

from recipes.tests import features  # noqa: E402
from titan_lightning.config import ConfigError, validate_job  # noqa: E402
from titan_lightning.recipe import ContextParallelTransform, apply_transforms  # noqa: E402


def _cp_run(attention="allgather", **degrees):
    run = features.llama3_debugmodel()
    run.job.model.attention = attention
    for name, value in degrees.items():
        setattr(run.job.parallelism, name, value)
    return run


@pytest.mark.parametrize("attention, degrees, message", [
    ("sdpa", dict(cp=2, dp_shard=1),
     r"parallelism.cp=2 needs a context-parallel attention, but model.attention='sdpa' cannot do CP"),
    ("ring", dict(cp=1), r"model.attention='ring' is a context-parallel attention but parallelism.cp=1"),
    ("allgather", dict(cp=2, dp_shard=1, cp_load_balancer="ptrr"), r"cp_load_balancer='ptrr' balances block-masked"),
    ("ulysses", dict(cp=4, tp=8, dp_shard=1),
     r"model.attention='ulysses' shards heads over tp\*cp: model.n_heads=16 must be divisible by parallelism.tp\*cp = 8\*4 = 32"),
])
def test_validation_refuses_cp_attention_mismatches_by_name(attention, degrees, message):
    run = _cp_run(attention, **degrees)
    p = run.job.parallelism
    with pytest.raises(ConfigError, match=message):
        validate_job(run.job, world_size=p.fixed_degrees * max(p.dp_shard, 1))


def test_sequence_length_must_split_into_2cp_chunks_times_tp_with_sp():
    run = _cp_run(cp=4, dp_shard=1)
    run.job.training.seq_len = 132  # divisible by 4, not by 2*cp = 8
    run.job.training.tokens_per_microbatch_per_dp_rank = 528
    with pytest.raises(ConfigError, match=r"training.seq_len=132 must be divisible by 8: 8 for cp=4 \(2\*cp with the headtail"):
        validate_job(run.job, world_size=4)
    run.job.parallelism.cp_load_balancer = None
    validate_job(run.job, world_size=4)  # contiguous slices need only cp
    run = _cp_run(cp=2, tp=2, dp_shard=1)
    run.job.training.seq_len = 132  # 4 | 132 (2*cp) and 2 | 132 (tp), but 8 does not
    run.job.training.tokens_per_microbatch_per_dp_rank = 528
    with pytest.raises(ConfigError, match=r"must be divisible by 8: 4 for cp=2 .* times tp=2 with sequence_parallel=True"):
        validate_job(run.job, world_size=4)


def test_apply_transforms_copies_validates_and_leaves_the_original_untouched_on_failure():
    base = features.llama3_debugmodel()
    ring = apply_transforms(base, [ContextParallelTransform(attention="ring", cp=2)])
    assert (ring.job.model.attention, ring.job.parallelism.cp) == ("ring", 2)
    assert (base.job.model.attention, base.job.parallelism.cp) == ("sdpa", 1)
    assert ring.module is not base.module and ring.datamodule.job is ring.job  # one job per run, shared
    with pytest.raises(ConfigError, match=r"model.n_heads=16 must be divisible by parallelism.tp\*cp = 1\*32"):
        apply_transforms(base, [ContextParallelTransform(attention="ulysses", cp=32)])
    assert (base.job.model.attention, base.job.parallelism.cp) == ("sdpa", 1)
    with pytest.raises(ValueError, match=r"ContextParallelTransform\(attention='flash'\): expected one of allgather"):
        ContextParallelTransform(attention="flash")


def test_a_model_mixing_cp_backends_is_refused_when_parallelized():
    from titan_lightning.parallel.context import apply_context_parallel
    from titan_lightning.models.common.attention import Attention

    class FakeMesh:
        def size(self):
            return 2

    model = torch.nn.ModuleList([Attention(8, 2, 2, "ring"), Attention(8, 2, 2, "ulysses")])
    with pytest.raises(ConfigError, match=r"one model mixes the context-parallel attentions \['ring', 'ulysses'\]"):
        apply_context_parallel(model, FakeMesh(), "headtail")
    with pytest.raises(ConfigError, match=r"has attention 'sdpa', which cannot do CP"):
        apply_context_parallel(torch.nn.ModuleList([Attention(8, 2, 2)]), FakeMesh(), "headtail")


def test_the_long_context_recipe_validates_at_world_size_64_and_its_data_fits_one_sequence():
    from recipes.llama3 import llama3_8b_fsdp8_cp8

    run = llama3_8b_fsdp8_cp8()
    validate_job(run.job, world_size=64, max_steps=run.trainer["max_steps"])
    p = run.job.parallelism
    assert (p.dp_shard, p.cp, run.job.training.seq_len, run.job.model.attention) == (8, 8, 131072, "allgather")
    from types import SimpleNamespace

    # (max_epochs -1: what Lightning sets for a run limited by max_steps, as this recipe is)
    run.datamodule.trainer = SimpleNamespace(limit_val_batches=run.trainer["limit_val_batches"], max_epochs=-1)
    run.datamodule.setup("fit")  # the train split is repeated to one 131,073-token window; no val split
    assert len(run.datamodule._train) >= 1


def test_thread_ranks_exchange_real_data_like_process_ranks():
    # The helper the GPU CP tests use (one device, several ranks): checked here on CPU.
    from cp_cases import attention_parity
    from titan_lightning.testing.threaded import run_threaded

    results = run_threaded(attention_parity, 2, backend="allgather", load_balancer="headtail", n_heads=4,
                           n_kv_heads=2, seq_len=32)
    assert len(results) == 2 and all(e[n] < 1e-10 for e in results for n in ("out", "dq", "dk", "dv"))
    low = run_threaded(attention_parity, 2, backend="ring", load_balancer="headtail", n_heads=4, n_kv_heads=2,
                       seq_len=64, dtype="bfloat16")
    for errors in low:  # bf16 ring merges in fp32: about as close as unsharded bf16 attention
        assert errors["out"] <= 4 * errors["baseline_out"] + 1e-3 * errors["scale"]
    with pytest.raises(RuntimeError, match=r"thread rank 0 of 2 failed: ValueError.*context-parallel attention backend 'nope' is not one of"):
        run_threaded(attention_parity, 2, backend="nope", load_balancer="headtail", n_heads=4, n_kv_heads=2, seq_len=32)


@pytest.mark.parametrize("balancer", ["headtail", None])
def test_ring_math_kernel_is_exact_too(balancer, monkeypatch):
    # The explicit fallback (fp64 on GPU, value head dim != query head dim) behind the flash kernels.
    from cp_cases import attention_parity
    from titan_lightning.parallel import context_ring
    from titan_lightning.testing.threaded import run_threaded

    monkeypatch.setattr(context_ring, "_ring_kernel", lambda q, v: "math")
    for errors in run_threaded(attention_parity, 2, backend="ring", load_balancer=balancer, n_heads=4,
                               n_kv_heads=2, seq_len=32):
        assert all(errors[name] < 1e-10 for name in ("out", "dq", "dk", "dv")), errors


@pytest.mark.parametrize("backend", ["allgather", "ring", "ulysses"])
def test_every_backend_takes_the_score_scale(backend):
    """Gemma 3's query_pre_attn_scalar ** -0.5, not head_dim ** -0.5: exact against full attention
    with that scale (fp64), and a wrong scale would not be."""
    from cp_cases import attention_parity, make_inputs, references
    from titan_lightning.testing.threaded import run_threaded

    for errors in run_threaded(attention_parity, 2, backend=backend, load_balancer="headtail", n_heads=4,
                               n_kv_heads=2, seq_len=32, scale=0.9):
        assert all(errors[name] < 1e-10 for name in ("out", "dq", "dk", "dv")), errors
    inputs = make_inputs(n_heads=4, n_kv_heads=2, seq_len=32)
    assert (references(inputs, scale=0.9)["reference"][0] - references(inputs)["reference"][0]).abs().max() > 1e-2


# Documents of random lengths (of 1 too) that cross the chunk and rank boundaries, and a row that
# is one document: every backend gives full block-causal attention (fp64: 1e-10).
DOCUMENTS = [[5, 1, 9, 1, 12, 4], [32]]


@pytest.mark.parametrize("backend", ["allgather", "ring", "ulysses"])
@pytest.mark.parametrize("balancer, cp", [("headtail", 2), ("headtail", 4), (None, 2)])
def test_every_backend_masks_documents_exactly(backend, balancer, cp):
    from cp_cases import attention_parity
    from titan_lightning.testing.threaded import run_threaded

    for errors in run_threaded(attention_parity, cp, backend=backend, load_balancer=balancer, n_heads=4,
                               n_kv_heads=4 if backend == "ulysses" and cp == 4 else 2, seq_len=32,
                               documents=DOCUMENTS):
        assert all(errors[name] < 1e-10 for name in ("out", "dq", "dk", "dv")), errors
