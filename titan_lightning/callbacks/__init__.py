from titan_lightning.callbacks.golden import GoldenNumerics
from titan_lightning.callbacks.metrics import TrainingMetrics

__all__ = ["GoldenNumerics", "TrainingMetrics"]
