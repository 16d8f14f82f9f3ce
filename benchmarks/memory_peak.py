"""What is alive at the peak of a recorded step: a text summary of CUDA memory snapshots.

    BENCH_MEMORY_SNAPSHOT=/tmp/mem python -m benchmarks.throughput --workload llama3_1b \\
        --contenders titan,torchtitan --steps 2 --warmup 3 --rounds 1
    python -m benchmarks.memory_peak /tmp/mem/titan.pickle /tmp/mem/torchtitan.pickle

The snapshot (``torch.cuda.memory._dump_snapshot``) holds the trace of every allocation and free
since recording began, with Python stacks, and the blocks alive when it was dumped. Replaying the
trace gives the allocated bytes over time; memory alive before recording began (parameters,
optimizer state) is the dump's total minus the trace's net change. At the peak, the live
allocations made during the recording are grouped by the first frame in first-party code
(titan_lightning, torchtitan, benchmarks, the recipe or the user's module), and by op name.
"""

import argparse
import collections
import pickle
from typing import Any

GIB = 1024**3
FIRST_PARTY = ("titan_lightning/", "torchtitan/", "benchmarks/", "recipes/")


def where(frames: list[dict[str, Any]], depth: int = 1) -> str:
    """The first ``depth`` first-party frames of a stack (innermost first), else the innermost frame."""
    own = [f for f in frames if any(p in f["filename"] for p in FIRST_PARTY)]
    chosen = own[:depth] or frames[:1]
    return " < ".join(f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in chosen) or "?"


def op_name(frames: list[dict[str, Any]]) -> str:
    """The innermost torch frame's function: which op or module allocated."""
    for f in frames:
        if "torch/" in f["filename"] and "memory" not in f["filename"]:
            return f"{f['filename'].split('torch/')[-1]}:{f['name']}"
    return "?"


def summarize(path: str, top: int) -> str:
    with open(path, "rb") as fh:
        snap = pickle.load(fh)
    device = next(i for i, t in enumerate(snap["device_traces"]) if t)
    trace = snap["device_traces"][device]
    end_total = sum(b["size"] for s in snap["segments"] if s.get("device", device) == device
                    for b in s["blocks"] if b["state"] == "active_allocated")
    live: dict[int, dict] = {}
    delta = peak_delta = 0
    peak_live: dict[int, dict] = {}
    preexisting_freed = peak_preexisting_freed = 0
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            delta += e["size"]
        elif e["action"] == "free_completed":
            delta -= e["size"]
            if live.pop(e["addr"], None) is None:
                preexisting_freed += e["size"]
        else:
            continue
        if delta > peak_delta:
            peak_delta, peak_live, peak_preexisting_freed = delta, dict(live), preexisting_freed
    initial = end_total - delta
    lines = [f"{path}: alive before the step {initial / GIB:.2f} GiB; peak {(initial + peak_delta) / GIB:.2f} GiB "
             f"(of which made during the step {sum(e['size'] for e in peak_live.values()) / GIB:.2f} GiB, "
             f"freed from before it {peak_preexisting_freed / GIB:.2f} GiB); {len(trace)} events"]
    for title, key in (("by first-party frame", lambda e: where(e.get("frames", []), 2)),
                       ("by torch frame", lambda e: op_name(e.get("frames", [])))):
        groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        for e in peak_live.values():
            g = groups[key(e)]
            g[0] += e["size"]
            g[1] += 1
        lines.append(f"  live at the peak, {title}:")
        for name, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"    {size / GIB:7.3f} GiB {n:5d}x  {name}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("snapshots", nargs="+")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    for path in args.snapshots:
        print(summarize(path, args.top))


if __name__ == "__main__":
    main()
