"""Profiler traces and memory snapshots of chosen steps (callbacks/profiling.py)."""

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class ProfilingConfig:
    # Optimizer steps (1-based) to trace with torch.profiler: <run folder>/profile/trace_step<N>_rank<r>.json,
    # a Chrome trace (chrome://tracing, Perfetto).
    trace_steps: list[int] = field(default_factory=list)
    # Steps whose CUDA allocations are recorded: <run folder>/profile/memory_step<N>_rank<r>.pickle
    # (https://pytorch.org/memory_viz). GPU only; ignored with a warning on CPU.
    memory_snapshot_steps: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("trace_steps", "memory_snapshot_steps"):
            bad = [s for s in getattr(self, name) if not isinstance(s, int) or s < 1]
            if bad:
                raise ValueError(f"profiling.{name} has {bad}; steps are integers >= 1")
