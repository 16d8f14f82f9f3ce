"""Activation checkpointing: same numbers as without, less kept for the backward, config errors by name."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recipes.tests import features
from titan_lightning.config import ActivationCheckpointConfig
from titan_lightning.models.llama3 import Llama3Module
from titan_lightning.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_lightning.testing.record import RecordSteps
from titan_lightning.trainer import RUN_DIR_ENV, build_trainer


@pytest.fixture(autouse=True)
def run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))


def _model(mode="none", option="op"):
    job = features.llama3_debugmodel().job
    job.model.n_layers = 4
    module = Llama3Module(job)
    with torch.device("meta"):
        module.model = module.build_model()
    module.materialize(torch.device("cpu"))
    apply_activation_checkpointing(module.model.layers.values(), mode, option)
    return module.model


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def _step(model):
    """Loss, gradients, the bytes the autograd graph kept for one forward, and the ops run."""
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    with _CountOps() as ops:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], sum(kept), ops.counts


def test_every_mode_gives_bitwise_the_same_loss_and_gradients_and_keeps_less():
    torch.use_deterministic_algorithms(True)
    try:
        results = {name: _step(_model(*args)) for name, args in {
            "none": ("none",), "full": ("full",), "op": ("selective", "op"), "op_lean": ("selective", "op_lean"),
            "every2": ("selective", "2")}.items()}
    finally:
        torch.use_deterministic_algorithms(False)
    loss, grads, kept, ops = results["none"]
    for name, (other_loss, other_grads, *_) in results.items():
        assert other_loss == loss, name
        assert all(torch.equal(a, b) for a, b in zip(grads, other_grads)), name
    assert results["full"][2] < results["every2"][2] < kept  # every other block: between
    mm, silu = torch.ops.aten.mm.default, torch.ops.aten.silu.default
    # full: each block's matmuls and activations run again; op: matmul outputs are saved,
    # only the elementwise work (SwiGLU's silu) runs again.
    assert results["full"][3][mm] > ops[mm] and results["full"][3][silu] == 2 * ops[silu]
    assert results["op"][3][mm] == ops[mm] and results["op"][3][silu] == 2 * ops[silu]
    # op_lean: every second matmul of a block runs again (wk, wo, w3 of Llama's seven: 3 per block).
    assert results["op_lean"][3][mm] == ops[mm] + 3 * len(_model().layers)


def test_full_recomputes_each_block_forward_in_the_backward():
    model = _model("full")
    calls = []
    for block in model.layers.values():
        block.attention.register_forward_hook(lambda *_: calls.append(1))
    _step(model)
    assert len(calls) == 2 * len(model.layers)
    assert {b.activation_checkpoint for b in model.layers.values()} == {"full"}
    picked = _model("selective", "3")
    assert [getattr(b, "activation_checkpoint", None) for b in picked.layers.values()] == [None, None, "full", None]


def test_the_strategy_applies_the_jobs_policy_and_training_matches():
    def fit(mode):
        run = features.llama3_debugmodel()
        run.job.activation_checkpoint.mode = mode
        record = RecordSteps()
        run.trainer.update(max_steps=2, callbacks=[record], accelerator="cpu", devices=1)
        build_trainer(run).fit(run.module, datamodule=run.datamodule)
        return record, run.module.model

    plain, _ = fit("none")
    checkpointed, model = fit("full")
    assert all(b.activation_checkpoint == "full" for b in model.layers.values())
    assert checkpointed.losses == pytest.approx(plain.losses, rel=1e-6)
    assert checkpointed.grad_norms == pytest.approx(plain.grad_norms, rel=1e-6)


@pytest.mark.parametrize("fields, message", [
    (dict(mode="some"), r"activation_checkpoint.mode='some' is not one of none, full, selective"),
    (dict(mode="selective", selective_ac_option="0"),
     r"activation_checkpoint.selective_ac_option='0' must be 'op', 'op_lean' or a positive integer N"),
    (dict(mode="selective", selective_ac_option="ops"), r"selective_ac_option='ops' must be 'op'"),
])
def test_bad_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ActivationCheckpointConfig(**fields)
