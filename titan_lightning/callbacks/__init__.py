from titan_lightning.callbacks.golden import GoldenNumerics
from titan_lightning.callbacks.metrics import TrainingMetrics
from titan_lightning.callbacks.preemption import PreemptionCheckpoint

__all__ = ["GoldenNumerics", "PreemptionCheckpoint", "TrainingMetrics"]
