"""titan_lightning: torchtitan-grade N-D parallelism behind PyTorch Lightning's Trainer."""

from titan_lightning.recipe import Run
from titan_lightning.strategies import FakePGStrategy, FSDP2Strategy, TensorParallelStrategy, TitanStrategy

__all__ = ["FSDP2Strategy", "FakePGStrategy", "Run", "TensorParallelStrategy", "TitanStrategy"]
