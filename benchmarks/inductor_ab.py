"""A callback that turns on Inductor's combo kernels (independent small kernels of one graph, e.g. the
adapters' per-step casts of their fp32 weights, launched as one): the B side of an A/B of that setting
in one run of the harness (`llama3_8b_lora_combo_quiet` against `llama3_8b_lora_quiet`). A measurement
of the setting, not a default of the trainer.

    BENCH_CLOCK=events python -m benchmarks.throughput --rounds 1 --steps 8 --warmup 6 --contenders titan \\
        --workload llama3_8b_lora_quiet,llama3_8b_lora_combo_quiet
"""

import lightning as L
import torch._inductor.config as inductor_config


class ComboKernels(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        inductor_config.combo_kernels = True  # (before the first compiled step: setup runs before fit's loop)
