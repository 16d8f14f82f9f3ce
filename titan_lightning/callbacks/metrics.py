"""Training metrics that are not the model's business: LR, throughput, MFU, memory.

The model logs its own loss and grad norm (``train/loss``, ``train/grad_norm``); this
callback adds, on every optimizer step whose metrics reach the loggers
(``trainer.log_every_n_steps``; the progress bar keeps the last ones in between):

    train/lr                   the learning rate of the latest step
    train/tokens_per_s         tokens the job trains per second, per device, over the steps since
                               the last logged one: the global batch (local batch x data-parallel
                               replicas) over the world size, so TP, CP and PP ranks, which share
                               their tokens, are divided out
    train/supervised_tokens_per_s  the same for the tokens the loss trains on (loss-masked
                               fine-tuning, ``data.sft``: modules with ``loss_over_step_tokens``)
    train/mfu                  model FLOPs utilization in percent: tokens/s per device x the
                               module's ``flops_per_token(seq_len)`` / the device's dense bf16
                               peak (GPUs in ``PEAK_FLOPS`` only)
    train/memory_peak_gib      peak allocated GPU memory in the steps since the last logged one,
    train/memory_reserved_gib  and what the caching allocator holds (GPU only)

Throughput is the host's clock between the ends of two logged optimizer steps (the first interval
starts with the first step of the fit), validation left out, every microbatch counted; checkpoint
saves in between count. The callback never waits for the device: a synchronization drains the
GPU's queue and leaves it idle while the host prepares the next step (data, metadata, launches).
The ones it used to make, with one blocking copy of the SFT normalization, made a logged SFT step of
the Qwen 2.5 1.5B shape take 421 ms instead of 351 on an H200 (benchmarks/RESULTS.md, "Fine-tuning
on one H200, run 4"). Host values are logged as CPU tensors (a number would become a GPU tensor:
a synchronizing copy); the supervised count stays on the device until Lightning reads the step's
metrics, with the loss.
"""

import time
from typing import Any, Optional

import lightning as L
import torch

from titan_lightning._compat import logs_this_step
from titan_lightning.models.common.loss import IGNORE_INDEX
from titan_lightning.steps import ends_optimizer_step, starts_optimizer_step

# The host clock the throughput is measured with (a test may replace it).
clock = time.perf_counter

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
    """Logs LR, tokens/s per device, MFU and memory on the logged optimizer steps (see the module docstring).

    ``peak_flops``: the device's peak FLOP/s, overriding the ``PEAK_FLOPS`` lookup.
    """

    def __init__(self, peak_flops: Optional[float] = None) -> None:
        self._peak_override = peak_flops
        self._peak: Optional[float] = None
        self._since: Optional[float] = None  # host time the interval began (None: at the next step)
        self._validating_since: Optional[float] = None
        self._left_out = 0.0  # seconds of validation inside the interval
        self._tokens = 0  # this rank's tokens in the interval
        self._supervised: Optional[torch.Tensor] = None  # on the device
        self._seq_len = 0
        self._lr = 0.0
        self._logs = False  # whether the optimizer step under way is logged
        self._reset_peak = False  # at the next microbatch's start

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = pl_module.device
        if self._peak_override is not None:
            self._peak = self._peak_override
        elif device.type == "cuda":
            self._peak = peak_flops(torch.cuda.get_device_name(device))
        self._since = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._since is None:
            self._restart(clock())
        if self._reset_peak and pl_module.device.type == "cuda":
            # Here, not at the logged step's end: a reader of the peak after the fit (a benchmark)
            # still sees a whole step's.
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._reset_peak = False
        if starts_optimizer_step(trainer, batch_idx):
            self._logs = logs_this_step(trainer)
            # The scheduler steps before on_train_batch_end; read the LR this step uses now.
            self._lr = trainer.optimizers[0].param_groups[0]["lr"]
        ids = batch["input_ids"]
        self._tokens += ids.numel()
        self._seq_len = ids.shape[-1]
        if getattr(pl_module, "loss_over_step_tokens", False) and "labels" in batch:
            supervised = (batch["labels"] != IGNORE_INDEX).sum()
            self._supervised = supervised if self._supervised is None else self._supervised + supervised

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._logs or not ends_optimizer_step(trainer, batch_idx):
            return
        self._logs = False
        now = clock()
        per_token = _data_parallel_size(trainer) / trainer.world_size / max(now - self._since - self._left_out, 1e-9)
        per_device = self._tokens * per_token
        pl_module.log("train/tokens_per_s", torch.tensor(per_device), prog_bar=True)
        if self._supervised is not None:
            pl_module.log("train/supervised_tokens_per_s", self._supervised.float() * per_token)
        pl_module.log("train/lr", torch.tensor(self._lr))
        flops = getattr(pl_module, "flops_per_token", None)
        if self._peak is not None and flops is not None:
            pl_module.log("train/mfu", torch.tensor(mfu(per_device, flops(self._seq_len), self._peak)), prog_bar=True)
        if pl_module.device.type == "cuda":
            for name, read in (("peak", torch.cuda.max_memory_allocated), ("reserved", torch.cuda.memory_reserved)):
                pl_module.log(f"train/memory_{name}_gib", torch.tensor(read(pl_module.device) / 2**30))
        self._restart(now)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._since is not None:
            self._validating_since = clock()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._validating_since is not None:
            self._left_out += clock() - self._validating_since
            self._validating_since = None

    def _restart(self, now: float) -> None:
        """Begin the next interval at host time ``now``; peak memory from its first microbatch on."""
        self._since, self._left_out, self._tokens, self._supervised = now, 0.0, 0, None
        self._reset_peak = True


def _data_parallel_size(trainer: L.Trainer) -> int:
    """Replicas that see different batches (the sampler's), the world size when unknown."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    if isinstance(kwargs, dict) and "num_replicas" in kwargs:
        return int(kwargs["num_replicas"])
    return trainer.world_size


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
            pl_module.log(f"data/tokens/{name}", torch.tensor(float(tokens)), on_step=True, on_epoch=False,
                          rank_zero_only=True)
