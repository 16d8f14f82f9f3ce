"""A callback that prints the device memory of a run by phase and after a few blocks of the first
two forwards: where a peak comes from when it differs from `titan-lightning estimate`'s (host RSS
on a CPU). For diagnosis, not timing (it reads the device after blocks).

    python -m titan_lightning.cli fit --recipe recipes.llama3:llama3_70b --trainer.callbacks+ \
        benchmarks.memory_probe.MemoryProbe --trainer.max_steps 3 --job.model.n_layers 16 \
        --job.lora.rank 16 --job.lora.alpha 32 --job.lora.quantize_base nf4 \
        --job.activation_checkpoint.mode full --job.compile.enable true \
        --job.training.seq_len 4096 --job.training.tokens_per_microbatch_per_dp_rank 4096

Run 7 (an H100, the command above): 10.7 GiB after the model was made, then +2.2 GiB after each
block's forward with the blocks' checkpoint compiled, where the estimate is 64 MiB a block.
"""

import os
import time

import lightning as L
import torch

GiB = 2**30


def memory() -> str:
    if torch.cuda.is_available():
        return (f"allocated {torch.cuda.memory_allocated() / GiB:.2f} GiB, "
                f"peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB")
    with open("/proc/self/statm") as f:  # (Linux: resident pages are the second number)
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return f"host RSS {rss / GiB:.2f} GiB"


class MemoryProbe(L.Callback):
    """Prints ``[memory t s] phase: ...`` lines; per block after blocks 0-2, every 8th and the last."""

    def __init__(self) -> None:
        self.start, self.step = time.time(), 0

    def show(self, phase: str) -> None:
        print(f"[memory {time.time() - self.start:6.1f} s] {phase}: {memory()}", flush=True)

    def setup(self, trainer, pl_module, stage) -> None:
        self.show("setup")

    def on_fit_start(self, trainer, pl_module) -> None:
        self.show("model made")

    def on_train_start(self, trainer, pl_module) -> None:
        blocks = getattr(pl_module.model, "layers", None) or []
        blocks = list(blocks.values() if hasattr(blocks, "values") else blocks)
        for i, block in enumerate(blocks):
            if i < 3 or i % 8 == 0 or i == len(blocks) - 1:
                block.register_forward_hook(self._after_block(i))

    def _after_block(self, i: int):
        def hook(module, args, output) -> None:
            if self.step < 2:
                self.show(f"step {self.step}, after block {i}")
        return hook

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.show(f"step {self.step} start")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.show(f"step {self.step} before backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self.show(f"step {self.step} after backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.show(f"step {self.step} end")
        self.step += 1

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.show(f"{type(exception).__name__}")
