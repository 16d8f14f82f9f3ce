"""A callback that puts the adapters' As back on one GEMM per layer (as before a block's q / k / v and
its gate / up computed theirs jointly under compile: ``LoRALinear.together``, titan_lightning/lora/layer.py):
the A side of an A/B of that change in one run of the harness (`llama3_8b_lora_separate_a_quiet` against
`llama3_8b_lora_quiet`).

    BENCH_CLOCK=events python -m benchmarks.throughput --rounds 1 --steps 8 --warmup 6 --contenders titan \\
        --workload llama3_8b_lora_quiet,llama3_8b_lora_separate_a_quiet
"""

import lightning as L

from titan_lightning.lora import LoRALinear


def _each_alone(x, linears):
    return tuple(linear(x) for linear in linears)


class SeparateAdapterInputs(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        LoRALinear.together = staticmethod(_each_alone)  # (before the first compiled step)
