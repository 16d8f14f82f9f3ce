"""Profile chosen optimizer steps: a torch.profiler trace and/or a CUDA memory snapshot per rank."""

import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

from titan_lightning._compat import dump_memory_snapshot, record_memory_history
from titan_lightning.steps import ends_optimizer_step, starts_optimizer_step


class ProfileSteps(L.Callback):
    """Trace steps ``trace_steps`` and record the allocations of ``memory_snapshot_steps`` into ``folder``.

    A step runs from the start of its first microbatch to the end of its last (gradient
    accumulation included); files are named ``trace_step<N>_rank<r>.json`` and
    ``memory_step<N>_rank<r>.pickle``.
    """

    def __init__(self, folder: Path, trace_steps: list[int] = (), memory_snapshot_steps: list[int] = ()) -> None:
        self.folder = Path(folder)
        self.trace_steps, self.memory_steps = set(trace_steps), set(memory_snapshot_steps)
        self._profiler: Optional[torch.profiler.profile] = None
        self._recording = False
        self._warned = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # One folder for every rank's trace: rank 0's (under torchrun or srun each rank named its own).
        self.folder = Path(trainer.strategy.broadcast(str(self.folder)))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if not starts_optimizer_step(trainer, batch_idx):
            return  # not the first microbatch of a step
        step = trainer.global_step + 1
        if step in self.trace_steps and self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if pl_module.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
            self._profiler.__enter__()
        if step in self.memory_steps:
            if pl_module.device.type != "cuda":
                if not self._warned:
                    warnings.warn("profiling.memory_snapshot_steps needs a GPU (CUDA allocator history); skipped")
                    self._warned = True
            else:
                record_memory_history(max_entries=200_000)
                self._recording = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not ends_optimizer_step(trainer, batch_idx):
            return
        step, rank = trainer.global_step, trainer.global_rank
        if self._profiler is not None and step in self.trace_steps:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self._profiler.__exit__(None, None, None)
            self.folder.mkdir(parents=True, exist_ok=True)
            self._profiler.export_chrome_trace(str(self.folder / f"trace_step{step}_rank{rank}.json"))
            self._profiler = None
        if self._recording and step in self.memory_steps:
            self.folder.mkdir(parents=True, exist_ok=True)
            dump_memory_snapshot(str(self.folder / f"memory_step{step}_rank{rank}.pickle"))
            record_memory_history(enabled=None)
            self._recording = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._profiler is not None:  # fit ended inside a traced step
            self._profiler.__exit__(None, None, None)
            self._profiler = None
