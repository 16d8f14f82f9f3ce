"""Runs the `models` integration suite trains: one small run per model family."""

from recipes.tests import features
from titan_lightning.recipe import Run


def llama3_debugmodel() -> Run:
    """Llama 3 debug model, one process (the features suite's baseline)."""
    return features.llama3_debugmodel()
