"""The `models` suite: breadth, each model family trained end to end."""

from titan_lightning.testing.entries import TestEntry

ENTRIES = [
    TestEntry(recipes=("recipes.tests.models:llama3_debugmodel",), name="llama3_debugmodel",
              description="Llama 3 debug model, one process"),
]
