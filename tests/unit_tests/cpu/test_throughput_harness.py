"""benchmarks/throughput.py: the bare loop is the same training as the Trainer path (so the
ratio between them is the framework's cost), and the table reports what the runs measured."""

import pytest

from benchmarks.throughput import WORKLOADS, run_bare, run_titan, summarize, table


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
