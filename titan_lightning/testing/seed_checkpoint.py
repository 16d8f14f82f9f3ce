"""Seed checkpoints: the full initial model of a recipe, written by one process, loadable by any layout.

Loss comparison starts the baseline and the tested layout from the same weights, whatever
each layout's own initialization would do::

    path = create_seed_checkpoint("recipes.tests.features:llama3_debugmodel", "seed.safetensors")
    trainer.callbacks.append(LoadSeedCheckpoint(path))   # before fit, on any layout

The file is safetensors, keyed by the names of the module's ``model`` (fp32 as initialized).
Loading shards each full tensor locally (no communication), so it works under real and fake
process groups alike. From a shell: ``python -m titan_lightning.testing.seed_checkpoint RECIPE PATH``.
"""

import sys
from pathlib import Path
from typing import Union

import lightning as L
import torch
from safetensors.torch import load_file, save_file

from titan_lightning.checkpoint import load_full_state_dict  # noqa: F401 (its home before checkpoint.py)
from titan_lightning.recipe import build_run


def create_seed_checkpoint(recipe: str, path: Union[str, Path]) -> Path:
    """Build ``recipe``'s model in this process with its own init and save it to ``path``."""
    run = build_run(recipe)
    module = run.module
    if not (hasattr(module, "build_model") and hasattr(module, "materialize")):
        raise TypeError(
            f"recipe {recipe}: {type(module).__name__} is not a CausalLMModule (no build_model/materialize); "
            f"a seed checkpoint needs a titan_lightning model"
        )
    with torch.device("meta"):
        module.model = module.build_model()
    module.materialize(torch.device("cpu"))
    state = {name: tensor.detach().contiguous() for name, tensor in module.model.state_dict().items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata={"recipe": recipe})
    return path


class LoadSeedCheckpoint(L.Callback):
    """Load a seed checkpoint into ``pl_module.model`` when fit starts (after parallelization)."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.path.is_file():
            raise FileNotFoundError(f"seed checkpoint {self.path} does not exist")
        partial = getattr(trainer.strategy, "pipeline", None) is not None
        load_full_state_dict(pl_module.model, load_file(str(self.path)), source=str(self.path), partial=partial)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m titan_lightning.testing.seed_checkpoint MODULE:FUNCTION PATH")
    print(create_seed_checkpoint(sys.argv[1], sys.argv[2]))
