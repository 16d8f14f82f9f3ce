"""titan_lightning: torchtitan-grade N-D parallelism behind PyTorch Lightning's Trainer.

``from titan_lightning import TitanStrategy``; the names load lazily, so tools such as the
test worker can start (and install signal handlers) before torch and lightning import.
"""

import importlib

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
