"""A callback that puts the gradient norm back on one compiled reduction per gradient (as before
the small gradients were packed, parallel/grad_norm.py): the A side of an A/B of that change in one
run of the harness (`llama3_8b_lora_norm_per_tensor_quiet` against `llama3_8b_lora_quiet`).

    BENCH_CLOCK=events python -m benchmarks.throughput --rounds 1 --steps 8 --warmup 6 --contenders titan \\
        --workload llama3_8b_lora_quiet,llama3_8b_lora_norm_per_tensor_quiet
"""

import lightning as L

from titan_lightning.parallel import grad_norm


class PerTensorGradNorm(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        grad_norm.PACKED_BELOW_NUMEL = 0  # (every gradient read in place, one call each)
