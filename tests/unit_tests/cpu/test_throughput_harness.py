"""benchmarks/throughput.py: the bare loop is the same training as the Trainer path (so the
ratio between them is the framework's cost), and the table reports what the runs measured."""

import argparse
import json
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from benchmarks.contenders import torchtitan_run
from benchmarks.throughput import (TORCHTITAN_SCRIPT, WORKLOADS, StepClock, _contender_command, kernel_breakdown,
                                   kernel_table, references_of, resolve_run, run_bare, run_titan, summarize, table,
                                   torchtitan_model, union_length_us)
from titan_lightning.data.tokenizer import CORPUS_PATH, TOKENIZER_PATH


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
    text = table(rows, references_of([("w", n) for n in rows], lambda wl, n: n, "bare"))
    assert "| titan | 5,000 | 5,000-5,000 | 0.500x bare |" in text
    assert "| bare | 10,000 | 10,000-10,000 | - |" in text
    assert "| hf | failed: exit 1: CUDA out of memory |" in text


def test_each_workload_is_compared_with_its_own_bare_loop():
    """Several workloads in one table: a row divides by its own workload's bare row (the 8B row once
    read 0.686x "vs bare" against the 1B bare loop while it was 1.004x its own), none without one."""
    runs = {("1b", "titan"): [0.1], ("1b", "bare"): [0.1], ("8b", "titan"): [0.4], ("8b", "bare"): [0.5],
            ("sft", "titan"): [0.2]}
    row = lambda wl, n: f"{n} ({wl})"  # noqa: E731
    rows = {row(wl, n): summarize([_run(t * 2)], None) for (wl, n), t in runs.items()}
    text = table(rows, references_of(list(runs), row, "bare"))
    assert "| titan (8b) | 2,500 | 2,500-2,500 | 1.250x bare |" in text
    assert "| titan (1b) | 10,000 | 10,000-10,000 | 1.000x bare |" in text
    assert "| titan (sft) | 5,000 | 5,000-5,000 | - |" in text
    named = table(rows, references_of(list(runs), row, "titan (sft)"))
    assert "| titan (8b) | 2,500 | 2,500-2,500 | 0.500x titan |" in named


def test_sft_rows_report_real_and_supervised_tokens():
    sft = dict(_run([0.1, 0.1]), tokens_share=0.9, supervised_share=0.5)
    text = table({"titan": summarize([sft], None), "bare": summarize([_run([0.1, 0.1])], None)})
    assert "| real tokens/s | supervised tokens/s |" in text.splitlines()[0]
    assert text.splitlines()[2].endswith("| 9,000 | 5,000 |")
    assert text.splitlines()[3].endswith("| - | - |")


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


TORCHTITAN_WORKLOADS = [name for name, w in WORKLOADS.items() if "torchtitan" in w.contenders]


class _Reads(dict):
    """A dict that records which keys were read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def _torchtitan_spec(name: str, tmp_path: Path) -> tuple[list[str], dict]:
    args = argparse.Namespace(layers=None, ac=None, device="cuda", steps=3, warmup=2, profile_steps=0, sdpa="default")
    command, _ = _contender_command("torchtitan", name, args, tmp_path / "result.json")
    return command, json.loads(command[command.index("--workload") + 1])


def test_torchtitan_runs_every_gpu_workload_it_has_the_model_for():
    for name in ("llama3_1b", "llama3_8b_shape", "llama3_8b_shape_float8_tensorwise", "llama3_8b_shape_float8_rowwise",
                 "qwen3_30b_a3b_shape", "deepseek_v3_16b_shape"):
        assert name in TORCHTITAN_WORKLOADS


@pytest.mark.parametrize("name", TORCHTITAN_WORKLOADS)
def test_torchtitan_command_names_existing_files_and_gives_every_key_the_runner_reads(name, tmp_path):
    """A move of the shipped corpus/tokenizer or of the runner, or a key the runner reads that the
    harness does not pass, fails here rather than on the GPU machine (torchtitan is not imported)."""
    if "float8" in name and find_spec("torchao") is None:
        pytest.skip('quantize.float8 needs torchao: pip install -e ".[float8]"')
    command, spec = _torchtitan_spec(name, tmp_path)
    assert Path(command[1]) == TORCHTITAN_SCRIPT and TORCHTITAN_SCRIPT.is_file()
    assert sorted(spec) == sorted(torchtitan_run.WORKLOAD_KEYS)
    torchtitan_run.check_workload(spec)
    # the titan row's data: the package's shipped files, where the data module reads them
    assert Path(spec["dataset_path"]) == CORPUS_PATH and CORPUS_PATH.is_file()
    assert Path(spec["tokenizer_path"]) / "tokenizer.json" == TOKENIZER_PATH and TOKENIZER_PATH.is_file()

    reads = _Reads(spec)
    torchtitan_run.check_workload(reads)
    flags = torchtitan_run.job_args(reads, 5, str(tmp_path))
    module, _, _, model = torchtitan_run.model_spec(reads)
    reads["batch"], reads["seq_len"]  # run() reads these for tokens_per_step
    assert reads.read == set(torchtitan_run.WORKLOAD_KEYS)  # no key passed in vain

    value = {flag: flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag.startswith("--")}
    assert (Path(value["--model.hf_assets_path"]) / "tokenizer.json").is_file()
    assert Path(value["--training.dataset_path"]).is_file()
    job = resolve_run(WORKLOADS[name], "cuda", 1).job
    a = job.model
    assert module == f"torchtitan.models.{spec['model']}" and value["--model.name"] == spec["model"]
    assert (spec["model"], model) == torchtitan_model(a, WORKLOADS[name].seq_len)
    assert (model["dim"], model["n_layers"], model["vocab_size"], model["max_seq_len"]) == (
        a.dim, a.n_layers, a.vocab_size, WORKLOADS[name].seq_len)
    if WORKLOADS[name].layers is not None:
        assert model["n_layers"] == WORKLOADS[name].layers
    if getattr(a, "moe", None) is not None:
        m = model["moe_args"]
        assert (m["num_experts"], m["top_k"], m["num_shared_experts"], m["score_func"], m["route_norm"],
                model["moe_inter_dim"]) == (a.moe.num_experts, a.moe.top_k, a.moe.num_shared_experts,
                                            a.moe.score_func, a.moe.route_norm, a.moe.hidden_dim)
    assert value["--training.seq_len"] == str(WORKLOADS[name].seq_len)
    assert value["--activation_checkpoint.mode"] == job.activation_checkpoint.mode
    assert ("--compile.enable" in flags) == job.compile.enable
    f8 = job.quantize.float8
    if f8.enable:
        assert value["--model.converters"] == "quantize.linear.float8"
        assert value["--quantize.linear.float8.recipe_name"] == f8.recipe
        assert "output" in value["--quantize.linear.float8.filter_fqns"].split(",")  # the head stays bf16, as ours
    else:
        assert "--model.converters" not in flags
    assert "torchtitan" not in sys.modules


def test_torchtitan_runner_rejects_a_missing_file_or_key_before_importing_torchtitan(tmp_path):
    _, spec = _torchtitan_spec("debug", tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer_path="):
        torchtitan_run.check_workload(dict(spec, tokenizer_path=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="dataset_path="):
        torchtitan_run.check_workload(dict(spec, dataset_path=str(tmp_path / "corpus.txt")))
    with pytest.raises(ValueError, match=r"missing keys \['seed'\], unknown keys \['dtype'\]"):
        torchtitan_run.check_workload({**{k: v for k, v in spec.items() if k != "seed"}, "dtype": "bf16"})
    assert "torchtitan" not in sys.modules


def test_every_workload_fits_its_model_positions():
    """A workload longer than its model's positions fails on the GPU machine only (OLMo 2 7B: 4096).
    (The fine-tuning rows read a folder made on that machine: their lengths are the folder's.)"""
    too_long = {name: (w.seq_len, job.model.max_seq_len) for name, w in WORKLOADS.items()
                if w.folder is None and (job := resolve_run(w, "cuda", 1).job).model.max_seq_len < w.seq_len}
    assert not too_long


def test_the_event_clock_times_steps_on_the_device_and_waits_once(monkeypatch):
    """BENCH_CLOCK=events on a GPU: each timed step records an event, no synchronization until the
    result (the events' times, the losses read then); profiled steps synchronize as before."""
    synchronized = []

    class Event:  # a CUDA event whose record() reads a device clock advancing 0.1 s a step
        now = 0.0

        def __init__(self, enable_timing: bool) -> None:
            self.at = None

        def record(self) -> None:
            Event.now += 0.1
            self.at = Event.now

        def elapsed_time(self, end: "Event") -> float:
            return (end.at - self.at) * 1e3  # milliseconds, as CUDA's

    monkeypatch.setenv("BENCH_CLOCK", "events")
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synchronized.append(len(clock.ends)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    clock = StepClock("cuda", warmup=2, steps=3)
    for i in range(clock.total):
        clock.step_done(torch.tensor(float(i)))
    assert synchronized == []
    result = clock.result("titan", 100, 1.0)
    assert synchronized == [5]
    assert result["step_times"] == pytest.approx([0.1, 0.1, 0.1])
    assert result["losses"] == [0.0, 1.0, 2.0, 3.0, 4.0]




def test_the_fine_tuning_workloads_give_each_recipe_the_data_it_needs(tmp_path, monkeypatch):
    """Each tiny folder workload resolves as the CLI resolves the user's command, with the prepared
    conversations or pairs as its data set (run 5 on an H200 lost recipes.hf:dpo_lora's row to a list of
    recipe names that missed it)."""
    import numpy as np

    import benchmarks.finetune_folder as finetune_folder
    import preference_cases
    from benchmarks.throughput import takes_dataset
    from titan_lightning.data.shards import tokenizer_identity
    from titan_lightning.data.tokenizer import load_tokenizer
    from titan_lightning.testing.sft_shards import synthetic_conversations, write_sft_shards

    folder, pairs = preference_cases.make_folders(tmp_path)
    pairs.rename(tmp_path / "pairs")  # (where the harness looks: next to the conversations)
    tokenizer = load_tokenizer(str(folder))
    identity = tokenizer_identity(folder / "tokenizer.json", tokenizer.vocab_size, tokenizer.eot_id,
                                  tokenizer.bos_id if tokenizer.add_bos else None)
    write_sft_shards(tmp_path / "data", [(np.where(t == 0, tokenizer.eot_id, t), m) for t, m in
                                         synthetic_conversations(40, vocab_size=tokenizer.vocab_size)],
                     tokenizer=identity)
    monkeypatch.setattr(finetune_folder, "folders", lambda shape, layers=None, root=None: (folder, tmp_path / "data"))
    tiny = {name: w for name, w in WORKLOADS.items() if w.as_user and w.folder == ("tiny", None)}
    assert {"tiny_sft", "tiny_lora", "tiny_dpo", "tiny_dpo_frozen", "tiny_dpo_lora"} <= set(tiny)
    for name, w in tiny.items():
        run = resolve_run(w, "cpu", 2)
        assert takes_dataset(w.recipe)
        assert run.job.data.dataset_path == str(tmp_path / ("pairs" if w.pairs else "data")), name
    assert not takes_dataset("recipes.hf:pretrained")
