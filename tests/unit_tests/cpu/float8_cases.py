"""Float8 recipes for test_float8.py (imported by the test and, through PYTHONPATH, by its ranks):
the small Llama 3 in torchao's emulation, on one process, FSDP over 2 or TP over 2, with a callback
that fails the rank unless the linears it trains are float8 (and the head is not)."""

import lightning as L
from torch import nn

from recipes.tests import features
from titan_lightning.recipe import Run, on_layout


class ExpectFloat8(L.Callback):
    """Fails the run unless every block linear is torchao's Float8Linear and the head a plain one."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = pl_module.model
        kinds = {float8(module) for name, module in model.named_modules()
                 if name.rsplit(".", 1)[-1] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")}
        if kinds != {True} or float8(model.output) or not isinstance(model.output, nn.Linear):
            raise AssertionError(f"block linears float8: {sorted(kinds)}, the head: {type(model.output).__name__}")


def float8(module: nn.Module) -> bool:
    """torchao's Float8Linear (or FSDP's subclass of it, once sharded)."""
    return any(cls.__name__ == "Float8Linear" for cls in type(module).__mro__)


def llama3_small_float8(recipe: str = "tensorwise") -> Run:
    run = features.llama3_small()
    f8 = run.job.quantize.float8
    f8.enable, f8.emulate, f8.recipe = True, True, recipe
    run.trainer["callbacks"] = [*run.trainer.get("callbacks", []), ExpectFloat8()]
    return run


def llama3_fsdp2_float8() -> Run:
    """FSDP over 2 ranks, the same global batch as one process."""
    return on_layout(llama3_small_float8(), dp_shard=2)


def llama3_tp2_float8() -> Run:
    """TP over 2 ranks without sequence parallelism (gloo cannot all-gather the float8 block inputs)."""
    return on_layout(llama3_small_float8(), dp_shard=1, tp=2, sequence_parallel=False)
