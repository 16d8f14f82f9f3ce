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
from torch.distributed.tensor import DTensor, distribute_tensor

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


@torch.no_grad()
def load_full_state_dict(
    model: torch.nn.Module, state: dict[str, torch.Tensor], *, source: str = "state dict", partial: bool = False
) -> None:
    """Copy full tensors into ``model``'s parameters and buffers, sharding DTensors locally.

    Every key of the model must be in ``state`` with the same global shape, and no other key;
    ``partial=True`` (a pipeline rank, which holds some stages) lets ``state`` have more.
    """
    own = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if partial:
        unexpected = []
    if missing or unexpected:
        raise KeyError(f"{source} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, target in own.items():
        full = state[name]
        if tuple(full.shape) != tuple(target.shape):
            raise ValueError(f"{source}: {name} has shape {tuple(full.shape)}, the model's is {tuple(target.shape)}")
        if isinstance(target, DTensor):
            full = full.to(device=target.device, dtype=target.dtype)
            local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
            target.to_local().copy_(local)
        else:
            target.copy_(full.to(device=target.device, dtype=target.dtype))


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
