"""titan_lightning: torchtitan-grade N-D parallelism behind PyTorch Lightning's Trainer.

``from titan_lightning import TitanStrategy``; the names load lazily, so tools such as the
test worker can start (and install signal handlers) before torch and lightning import.

What the library says goes through ``logging``, to the logger of its module (under
``titan_lightning``): INFO lines on stdout and warnings on stderr, as they were printed before
(``logging.getLogger("titan_lightning")`` to silence, redirect or reformat them).
"""

import importlib
import logging
import sys


class _Terminal(logging.Handler):
    """A record's message, alone, on the ``sys.stdout`` (INFO) or ``sys.stderr`` (warnings and
    errors) of the moment (a redirect or a test's capture), flushed at once."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
_logger.addHandler(_Terminal())
_logger.propagate = False  # (the lines as printed: a root handler would add its own format)

_EXPORTS = {
    "Run": "titan_lightning.recipe",
    "TitanStrategy": "titan_lightning.strategies",
    "FSDP2Strategy": "titan_lightning.strategies",
    "TensorParallelStrategy": "titan_lightning.strategies",
    "FakePGStrategy": "titan_lightning.strategies",
    "ContextParallelStrategy": "titan_lightning.strategies",
    "ExpertParallelStrategy": "titan_lightning.strategies",
    "PipelineParallelStrategy": "titan_lightning.strategies",
    "PipelinePlan": "titan_lightning.parallel.pipeline",
    "ContextParallelTransform": "titan_lightning.recipe",
    "apply_transforms": "titan_lightning.recipe",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'titan_lightning' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
