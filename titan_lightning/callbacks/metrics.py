"""Per-step training metrics that are not the model's business: LR, throughput, MFU, memory.

The model logs its own loss and grad norm (``train/loss``, ``train/grad_norm``); this
callback adds, after every optimizer step:

    train/lr                   the learning rate the step used
    train/tokens_per_s         tokens the job trains per second, per device: the global batch
                               (local batch x data-parallel replicas) over the world size, so
                               TP, CP and PP ranks, which share their tokens, are divided out
    train/supervised_tokens_per_s  the same for the tokens the loss trains on (loss-masked
                               fine-tuning, ``data.sft``: modules with ``loss_over_step_tokens``)
    train/mfu                  model FLOPs utilization in percent: tokens/s per device x the
                               module's ``flops_per_token(seq_len)`` / the device's dense bf16
                               peak (GPUs in ``PEAK_FLOPS`` only)
    train/memory_peak_gib      peak allocated GPU memory during the step, and what the caching
    train/memory_reserved_gib  allocator holds (GPU only)

Step time runs from the start of the first microbatch of an optimizer step to the end of
its last one, so gradient accumulation is counted once per step.

The values are measured and logged on the steps whose metrics reach the loggers
(``trainer.log_every_n_steps``; the progress bar keeps the last ones in between). Every
``self.log`` call costs Lightning about a millisecond of host time, and every device
synchronization exposes the host work that follows it; doing both on every step of a
200 ms GPU step cost 3% of the throughput (benchmarks/RESULTS.md).
"""

import time
from typing import Any, Optional

import lightning as L
import torch

from titan_lightning._compat import logs_this_step
from titan_lightning.models.common.loss import IGNORE_INDEX
from titan_lightning.steps import ends_optimizer_step

# Dense bf16 peak FLOP/s by a substring of torch.cuda.get_device_name() (first match wins; add
# yours here or pass peak_flops=): our H200 reports "NVIDIA H200".
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


def peak_flops(device_name: str, table: Optional[dict[str, float]] = None) -> Optional[float]:
    """The dense bf16 peak of the device named ``device_name``, or None when it is not known."""
    for key, value in (table or PEAK_FLOPS).items():
        if key in device_name:
            return value
    return None


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilization, in percent."""
    return 100.0 * tokens_per_s_per_device * flops_per_token / peak


class TrainingMetrics(L.Callback):
    """Logs LR, tokens/s per device, MFU and memory after every optimizer step (see the module docstring).

    ``peak_flops``: the device's peak FLOP/s, overriding the ``PEAK_FLOPS`` lookup.
    """

    def __init__(self, peak_flops: Optional[float] = None) -> None:
        self._peak_override = peak_flops
        self._step_start: Optional[float] = None
        self._tokens = 0
        self._supervised: Optional[torch.Tensor] = None
        self._seq_len = 0
        self._lr = 0.0
        self._peak: Optional[float] = None
        self._measuring = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = pl_module.device
        if self._peak_override is not None:
            self._peak = self._peak_override
        elif device.type == "cuda":
            self._peak = peak_flops(torch.cuda.get_device_name(device))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._step_start is None:
            self._measuring = logs_this_step(trainer)
            if not self._measuring:
                self._step_start = 0.0  # an optimizer step under way, not measured
                return
            _synchronize(pl_module.device)
            if pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(pl_module.device)
            self._step_start = time.perf_counter()
            self._tokens = 0
            self._supervised = None
            # The scheduler steps before on_train_batch_end; read the LR this step used now.
            self._lr = trainer.optimizers[0].param_groups[0]["lr"]
        if not self._measuring:
            return
        ids = batch["input_ids"]
        self._tokens += ids.numel()
        self._seq_len = ids.shape[-1]
        if getattr(pl_module, "loss_over_step_tokens", False) and "labels" in batch:
            supervised = (batch["labels"] != IGNORE_INDEX).sum()  # on the device: read after the step
            self._supervised = supervised if self._supervised is None else self._supervised + supervised

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not ends_optimizer_step(trainer, batch_idx):
            return
        if not self._measuring:
            self._step_start = None
            return
        _synchronize(pl_module.device)
        elapsed = time.perf_counter() - self._step_start
        self._step_start = None
        per_device = self._tokens * _data_parallel_size(trainer) / trainer.world_size / elapsed
        # Progress-bar values as CPU tensors: Lightning reads them on the host after every step
        # (a number would become a tensor on the GPU, and each read would wait for the device).
        pl_module.log("train/tokens_per_s", torch.tensor(per_device), prog_bar=True)
        if self._supervised is not None:
            supervised = int(self._supervised) * _data_parallel_size(trainer) / trainer.world_size / elapsed
            pl_module.log("train/supervised_tokens_per_s", torch.tensor(supervised))
        pl_module.log("train/lr", self._lr)
        flops = getattr(pl_module, "flops_per_token", None)
        if self._peak is not None and flops is not None:
            pl_module.log("train/mfu", torch.tensor(mfu(per_device, flops(self._seq_len), self._peak)), prog_bar=True)
        if pl_module.device.type == "cuda":
            pl_module.log("train/memory_peak_gib", torch.cuda.max_memory_allocated(pl_module.device) / 2**30)
            pl_module.log("train/memory_reserved_gib", torch.cuda.memory_reserved(pl_module.device) / 2**30)


def _data_parallel_size(trainer: L.Trainer) -> int:
    """Replicas that see different batches (the sampler's), the world size when unknown."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    if isinstance(kwargs, dict) and "num_replicas" in kwargs:
        return int(kwargs["num_replicas"])
    return trainer.world_size


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SourceTokens(L.Callback):
    """With a data mixture (``data.sources``): ``data/tokens/<source>``, the training tokens each
    source has given the run so far (all ranks), after every optimizer step."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if not ends_optimizer_step(trainer, batch_idx) or not hasattr(datamodule, "source_tokens"):
            return
        if not getattr(datamodule.job.data, "sources", None):
            return
        for name, tokens in datamodule.source_tokens().items():
            pl_module.log(f"data/tokens/{name}", float(tokens), on_step=True, on_epoch=False, rank_zero_only=True)
