from titan_lightning.callbacks.metrics import TrainingMetrics

__all__ = ["TrainingMetrics"]
