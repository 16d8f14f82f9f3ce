"""The features suite's debug-model recipes on a smaller shape (2 layers of width 64), for tests
of a tool or a launch, not of the model (test_loss_compare.py, test_run_tests.py): imported
through PYTHONPATH, by the test and by the processes the tool starts."""

from recipes.tests import features
from titan_lightning.recipe import Run


def _small(run: Run) -> Run:
    model = run.job.model
    model.dim, model.n_layers, model.n_heads, model.n_kv_heads = 64, 2, 4, 4
    return run


def llama3_debugmodel() -> Run:
    return _small(features.llama3_debugmodel())


def llama3_fsdp2() -> Run:
    return _small(features.llama3_fsdp2())
