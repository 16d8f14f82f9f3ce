"""What a step logs when Lightning's one ``self.log`` per step is not enough: with several
microbatches per optimizer step (pipeline microbatches, or gradient accumulation in a titan_lightning
module, one with a ``job``), the module's ``self.log`` calls are recorded, averaged over the
microbatches and replayed once, at the step's last, so the progress bar, loggers, checkpoint
monitors and golden numerics see the step's value, as with one big batch. Under pipeline
parallelism the last stage records and every rank replays. A LightningModule of one's own under
gradient accumulation (no pipeline) logs as under Lightning's strategies: nothing is recorded."""

import inspect
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from lightning.pytorch import LightningModule

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

Record = tuple[str, Any, dict]  # (name, value, self.log's options)


@contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name`` is ``value`` inside the block (an instance attribute; the class's is left alone)."""
    had = name in obj.__dict__
    old = obj.__dict__.get(name)
    object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        if had:
            object.__setattr__(obj, name, old)
        else:
            delattr(obj, name)


def record_logs(records: list):
    """A stand-in for ``LightningModule.log`` that appends (name, value, options) to ``records``."""

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        options = _LOG_SIGNATURE.bind(None, name, value, *args, **kwargs).arguments  # (positional options too)
        records.append((name, value, {k: v for k, v in options.items() if k not in ("self", "name", "value")}))

    return record


_LOG_SIGNATURE = inspect.signature(LightningModule.log)


def average_records(records: list[Record], *, pipeline: bool = True) -> list[Record]:
    """One (name, value, options) per logged name: the mean over the microbatches that logged it (a
    torchmetrics Metric: the last, which holds the step's state; under a pipeline, refused)."""
    from torchmetrics import Metric

    grouped: dict[str, tuple[list, dict]] = {}
    for name, value, kwargs in records:
        if isinstance(value, Metric) and pipeline:
            raise TypeError(
                f"self.log({name!r}, <{type(value).__name__}>) under pipeline parallelism: the metric lives on the "
                f"last stage only; log its computed value instead"
            )
        grouped.setdefault(name, ([], kwargs))[0].append(value)
    out = []
    for name, (values, kwargs) in grouped.items():
        if isinstance(values[0], (Tensor, float, int)) and not isinstance(values[0], bool):
            tensors = [local(v).detach() if isinstance(v, Tensor) else torch.tensor(float(v)) for v in values]
            out.append((name, mean(tensors), kwargs))
        else:
            out.append((name, values[-1], kwargs))
    return out


def replay_records(module: Any, records: list[Record], device: torch.device) -> None:
    for name, value, kwargs in records:
        module.log(name, to_device(value, device), **kwargs)


class StepLogs:
    """What training_step logged in the microbatches of the optimizer step so far."""

    def __init__(self) -> None:
        self._window: list[Record] = []

    def add(self, records: list[Record], module: Any, device: torch.device, *, ends_step: bool) -> None:
        """One microbatch's records; at the step's last microbatch, the step's mean is logged."""
        self._window += average_records(records, pipeline=False)
        if ends_step:
            window, self._window = average_records(self._window, pipeline=False), []
            replay_records(module, window, device)


def local(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def mean(values: list) -> Optional[Tensor]:
    """The mean (in float64, then the values' dtype, on the CPU) of the values that are not None."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    stacked = torch.stack([v.to(torch.float64) for v in values])
    return stacked.mean().to(values[0].dtype).cpu()


def to_device(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, Tensor) else value
