"""torch.compile of the model's blocks and of the loss (parallel/compile.py)."""

from dataclasses import dataclass, field

COMPONENTS = ("model", "loss", "moe")


@dataclass(kw_only=True)
class CompileConfig:
    enable: bool = False
    # "model": each transformer block's forward, compiled on its own (after TP/CP/EP and
    # activation checkpointing, before FSDP), its MoE layer left eager; "loss": the cross-entropy;
    # "moe": with "model", the MoE layers inside the blocks too, where their token path reads
    # nothing on the host (the bf16 grouped GEMM, on one device, FSDP/HSDP/DDP without EP, or EP
    # with parallelism.ep_dispatch='padded' and no FSDP); elsewhere (TP, 'splits' EP, FSDP with
    # EP, fp32, the per-expert loop of CPUs) they stay eager and the run's log says why.
    components: list[str] = field(default_factory=lambda: ["model", "loss", "moe"])
    # A torch.compile backend: "inductor" (kernels; GPU), "aot_eager" (traced graphs without
    # code generation: the CPU tests use it to check composition quickly), ...
    backend: str = "inductor"
    fullgraph: bool = True

    def __post_init__(self) -> None:
        unknown = [c for c in self.components if c not in COMPONENTS]
        if unknown:
            raise ValueError(f"compile.components has {unknown}; valid components are {', '.join(COMPONENTS)}")
        if not isinstance(self.backend, str) or self.backend not in compile_backends():
            raise ValueError(f"compile.backend={self.backend!r} is not a torch.compile backend; valid: "
                             f"{', '.join(b for b in compile_backends() if not b.endswith('_TESTING_ONLY'))}")


def compile_backends() -> list[str]:
    """The names ``torch.compile(backend=...)`` accepts here (debug and experimental ones too, and
    those of installed packages' ``torch_dynamo_backends`` entry points)."""
    from titan_lightning._compat import list_backends  # (start-up time: config/ imports no torch)

    return list_backends(exclude_tags=())
