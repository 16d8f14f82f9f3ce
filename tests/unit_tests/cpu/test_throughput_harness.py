"""benchmarks/throughput.py: the bare loop is the same training as the Trainer path (so the
ratio between them is the framework's cost), and the table reports what the runs measured."""

import pytest

from benchmarks.throughput import (WORKLOADS, StepClock, kernel_breakdown, kernel_table, run_bare, run_titan, summarize,
                                   table, union_length_us)


@pytest.mark.slow
def test_bare_loop_trains_exactly_like_the_titan_trainer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TITAN_LIGHTNING_RUN_DIR", raising=False)
    w = WORKLOADS["overhead"]
    titan = run_titan(w, "cpu", steps=2, warmup=1)
    bare = run_bare(w, "cpu", steps=2, warmup=1)
    assert len(titan["losses"]) == len(bare["losses"]) == 3
    assert titan["losses"] == bare["losses"]  # same init, tokens, kernels and optimizer: bitwise
    assert len(titan["step_times"]) == len(bare["step_times"]) == 2
    assert titan["tokens_per_step"] == bare["tokens_per_step"] == w.seq_len
    assert titan["flops_per_token"] == bare["flops_per_token"] > 0


def _run(times, peak=None, losses=(3.0, 2.0)):
    return {"step_times": times, "tokens_per_step": 1000, "flops_per_token": 2e9, "peak_memory_bytes": peak,
            "losses": list(losses), "wall_s": 1.0}


def test_summary_takes_the_median_step_over_all_rounds_and_the_spread_of_round_medians():
    row = summarize([_run([1.0, 2.0, 3.0], peak=2**31), _run([2.0, 4.0, 4.0], peak=2**30)], peak=1e12)
    assert row["tokens_per_s"] == 1000 / 2.5  # median of all six steps
    assert (row["round_min"], row["round_max"]) == (1000 / 4.0, 1000 / 2.0)
    assert row["peak_gib"] == 2.0
    assert row["mfu"] == pytest.approx(100 * 400 * 2e9 / 1e12)
    assert (row["first_loss"], row["last_loss"], row["steps"], row["rounds"]) == (3.0, 2.0, 6, 2)


def test_table_compares_with_the_bare_loop_and_reports_failures():
    rows = {"titan": summarize([_run([0.2, 0.2])], None), "bare": summarize([_run([0.1, 0.1])], None),
            "hf": summarize([{"contender": "hf", "error": "exit 1: CUDA out of memory", "wall_s": 3.0}], None)}
    text = table(rows)
    assert "| titan | 5,000 | 5,000-5,000 | 0.500x |" in text
    assert "| bare | 10,000 | 10,000-10,000 | 1.000x |" in text
    assert "| hf | failed: exit 1: CUDA out of memory |" in text


def test_device_busy_time_counts_overlapping_kernels_once():
    assert union_length_us([]) == 0
    assert union_length_us([(0, 10), (5, 12), (12, 13), (20, 30), (21, 25)]) == 13 + 10


def test_profiled_steps_come_after_the_timed_ones_and_are_not_timed():
    clock = StepClock("cpu", warmup=2, steps=3, profile_steps=2)
    assert clock.total == 7
    for i in range(clock.total):
        clock.step_done(float(i))
    result = clock.result("bare", 100, 1.0)
    assert len(result["step_times"]) == 3 and len(result["losses"]) == 7
    assert clock.ends[4] < clock.ends[5]  # the profiler started between the timed and the traced steps
    assert result["step_times"][-1] == clock.ends[4] - clock.ends[3]
    assert result["profile"]["busy_ms"] is None  # no device events on the CPU
    assert result["profile"]["wall_ms"] == pytest.approx(1e3 * (clock.ends[7] - clock.ends[5]) / 2)


def test_table_shows_device_busy_time_when_profiled():
    profiled = dict(_run([0.2, 0.2]), profile={"wall_ms": 200.0, "busy_ms": 150.0})
    rows = {"titan": summarize([profiled], None), "bare": summarize([_run([0.1, 0.1])], None)}
    text = table(rows)
    assert "device busy ms / profiled step ms |" in text.splitlines()[0]
    assert text.splitlines()[2].endswith("| 150.0 / 200.0 (75%) |")
    assert text.splitlines()[3].endswith("| - |")


def test_kernel_breakdown_groups_device_time_per_step_by_family():
    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256_h_bz_coopA_NTN", "ts": 0, "dur": 4000},
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256_h_bz_coopA_NTN", "ts": 5000, "dur": 4000},
        {"ph": "X", "cat": "kernel", "name": "void at::native::_grouped_mm_kernel<bf16>", "ts": 9000, "dur": 2000},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_silu_mul_0", "ts": 11000, "dur": 500},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 12000, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000},  # host side: not counted
    ]
    k = kernel_breakdown(events, steps=2)
    assert k["launches"] == 2.5
    kinds = {e["name"]: (e["ms"], e["launches"]) for e in k["kinds"]}
    assert kinds == {"gemm": (4.0, 1.0), "grouped gemm": (1.0, 0.5), "compiled (triton)": (0.25, 0.5),
                     "memcpy / memset": (0.05, 0.5)}
    assert k["top_kernels"][0] == {"name": "nvjet_tst_128x256_h_bz_coopA_NTN", "ms": 4.0, "launches": 1.0}
    assert kernel_breakdown([events[-1]], steps=1) == {}  # no device events (CPU)
    row = summarize([dict(_run([0.2]), profile={"wall_ms": 20.0, "busy_ms": 10.0, **k})], None)
    assert "gemm" in kernel_table({"titan": row}) and "4.00 ms" in kernel_table({"titan": row})
