"""features.llama3_small (the debug model cut to 2 layers of width 128) and its FSDP2 layout, for
tests of a tool, not of the model (test_loss_compare.py, test_run_tests.py): imported through
PYTHONPATH, by the test and by the processes the tool starts."""

from titan_lightning.recipe import on_layout
from recipes.tests import features
from titan_lightning.recipe import Run


def llama3_debugmodel() -> Run:
    return features.llama3_small()


def llama3_fsdp2() -> Run:
    return on_layout(features.llama3_small(), dp_shard=2)
