"""A LightningModule written for plain Lightning that calls its network outside the step hooks:
in ``on_validation_epoch_end``, ``on_train_end``, a callback's ``on_train_batch_end``, and in the
user's script after ``trainer.fit`` returns (then saves, reads the state dict, validates again).
Run on 1, 2 or 4 ranks by test_dropin.py (``titan_lightning.testing.spawn``, the Trainer starting
the process group as in a user's script); every number must match the one-process run.
"""

from pathlib import Path

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from lightning_styles import SubmoduleModule, TwoPartModule, regression_data
from titan_lightning.parallel.grad_norm import global_grad_norm
from titan_lightning.strategies import TitanStrategy

PROBE = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))


def _values(tensor: torch.Tensor) -> list[float]:
    return tensor.detach().flatten().tolist()


def probe(call) -> list[float]:
    """``call(PROBE)`` under no_grad: what an evaluation or a sampling loop does."""
    with torch.no_grad():
        return _values(call(PROBE))


def probe_gradients(call, module: torch.nn.Module) -> dict:
    """A backward through ``call`` outside training (a saliency map): the input's gradient and the
    parameters' gradient norm, then the gradients cleared."""
    x = PROBE.clone().requires_grad_()
    call(x).pow(2).sum().backward()
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    norm = global_grad_norm(grads).item()
    module.zero_grad(set_to_none=True)
    return {"input_grad": _values(x.grad), "grad_norm": norm, "params_with_grads": len(grads)}


def _sharded(module: torch.nn.Module) -> bool:
    """Every parameter is an FSDP shard again (nothing left gathered)."""
    return all(isinstance(p, DTensor) for p in module.parameters())


class Recorder:
    def __init__(self) -> None:
        self.values: dict = {}


class Evaluating(SubmoduleModule):
    """Evaluates in its own hooks, the submodule called directly (never ``self(x)``)."""

    def __init__(self, batch_size: int, recorder: Recorder) -> None:
        super().__init__(batch_size)
        self.recorder = recorder

    def forward(self, x):
        return self.model(x)

    def on_validation_epoch_end(self) -> None:
        self.recorder.values[f"val_end_{self.global_step}"] = probe(self.model)

    def on_train_end(self) -> None:
        values = self.recorder.values
        values["train_end"] = probe(self.model)
        values["train_end_embed"] = probe(self.model.embed)  # a root-level leaf on its own
        values["train_end_self"] = probe(self)  # the LightningModule itself
        values["train_end_gradients"] = probe_gradients(self.model, self)
        values["train_end_sharded"] = _sharded(self)


class ProbeEachStep(L.Callback):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        values = self.recorder.values
        network = getattr(pl_module, "model", None) or pl_module  # (two parts: the LightningModule itself)
        values[f"step_{trainer.global_step}"] = probe(network)
        if trainer.global_step == 2:
            values["step_2_gradients"] = probe_gradients(network, pl_module)
        values[f"step_{trainer.global_step}_sharded"] = _sharded(pl_module)


def evaluate_outside_steps(rank: int, world_size: int, out: str, module: str = "submodule") -> dict:
    recorder = Recorder()
    batch_size = 8 // world_size
    model = Evaluating(batch_size, recorder) if module == "submodule" else TwoPartEvaluating(batch_size, recorder)
    trainer = L.Trainer(
        strategy=TitanStrategy(dp_shard=world_size), accelerator="cpu", devices=world_size, max_steps=4,
        limit_val_batches=2, val_check_interval=2, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[ProbeEachStep(recorder)],
        default_root_dir=out)
    trainer.fit(model)
    values = recorder.values

    # The user's script, after fit returned.
    network = model.model if module == "submodule" else model.encoder
    values["after_fit"] = probe(network)
    values["after_fit_gradients"] = probe_gradients(network, model)
    state = trainer.strategy.lightning_module_state_dict()
    values["state_dict_keys"] = sorted(state)
    weight = model.model.head.weight if module == "submodule" else model.decoder.head.weight
    values["head_weight"] = _values(weight.full_tensor() if isinstance(weight, DTensor) else weight)
    trainer.save_checkpoint(Path(out) / "after_fit.ckpt")
    (metrics,) = trainer.validate(model, dataloaders=regression_data(batch_size), verbose=False)
    values["validate_after_fit"] = metrics["val/loss"]
    values["after_fit_sharded"] = _sharded(model)
    if world_size == 1:  # (one process: nothing is sharded, the flags say nothing)
        values = {k: v for k, v in values.items() if not k.endswith("_sharded")}
    return values


class TwoPartEvaluating(TwoPartModule):
    """Two parts and a parameter of the LightningModule itself, used outside the steps too."""

    def __init__(self, batch_size: int, recorder: Recorder) -> None:
        super().__init__(batch_size)
        self.recorder = recorder

    def forward(self, x):
        return self.decoder(self.encoder(x) * self.scale)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self.recorder.values[f"val_end_{self.global_step}"] = probe(self)

    def on_train_end(self) -> None:
        self.recorder.values["train_end"] = probe(self.encoder)
        self.recorder.values["train_end_scale"] = _values(self.scale.full_tensor() if isinstance(self.scale, DTensor)
                                                          else self.scale)
        self.recorder.values["train_end_gradients"] = probe_gradients(self, self)
