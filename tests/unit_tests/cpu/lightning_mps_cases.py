"""Lightning's own ModelParallelStrategy integration tests, rewritten for CPU/gloo, run with
``TitanStrategy`` swapped in (or with ModelParallelStrategy itself, the control).

Source: Lightning-AI/pytorch-lightning, ``tests/tests_pytorch/strategies/test_model_parallel_integration.py``
(Apache-2.0). Each case below keeps the checks of the test of the same name; the changes are the
ones a CPU needs (``accelerator="cpu"``, device asserts on "cpu", bf16-true runs on the CPU too)
and ``torch.compile(..., backend="aot_eager")`` instead of inductor (what the cases check, the
``_orig_mod`` wrapper and DTensor parameters, does not depend on the backend; inductor on CPU
would cost minutes). The strategy class is the only other difference: ``Strategy`` below.

The ``cross_*`` cases at the end are ours: a checkpoint of either strategy resumes under the other.

Run by test_lightning_mps_cases.py: ``python -m lightning_mps_cases --out DIR -- STRATEGY CASE...``
on as many ranks as the cases' ``devices``. Every case of one launch runs in the same processes,
one after the other (so a second ``fit`` after the first, in the same process group, is under test
too); each rank writes ``DIR/rank{r}.json`` with ``{case: "passed" | traceback}``.
"""

import json
import os
import sys
import traceback
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, DistributedSampler

from titan_lightning.strategies import TitanStrategy

Strategy = ModelParallelStrategy  # set by main()
# The one place the TitanStrategy runs differ from a plain swap: without sizes, ModelParallelStrategy
# puts TP over a node's devices and TitanStrategy FSDP over every rank (its documented default);
# the tensor-parallel test asks for ModelParallelStrategy's default by name ("auto" sizes).
TP_DEFAULT: dict = {}


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(32, 64)
        self.w2 = nn.Linear(32, 64)
        self.w3 = nn.Linear(64, 32)

    def forward(self, x):
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


def tp(model, device_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"w1": ColwiseParallel(), "w2": ColwiseParallel(), "w3": RowwiseParallel()}
    parallelize_module(model, device_mesh["tensor_parallel"], plan)
    return model


def fsdp2(model, device_mesh):
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    assert mesh.ndim == 1
    for linear in (model.w1, model.w2, model.w3):
        fully_shard(linear, mesh=mesh)
    return model


def fsdp2_tp(model, device_mesh):
    return fsdp2(tp(model, device_mesh), device_mesh)


def compiled(parallelize):
    def apply(model, device_mesh):
        return torch.compile(parallelize(model, device_mesh), backend="aot_eager")

    return apply


class TemplateModel(LightningModule):
    parallelize = None

    def __init__(self, compile=False):
        super().__init__()
        self.model = FeedForward()
        self._compile = compile

    def configure_model(self):
        if self.parallelize is not None:
            apply = compiled(type(self).parallelize) if self._compile else type(self).parallelize
            apply(self.model, self.device_mesh)

    def training_step(self, batch):
        return self.model(batch).sum()

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 8), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters())


class FSDP2Model(TemplateModel):
    parallelize = fsdp2_tp


class TensorParallelModel(TemplateModel):
    parallelize = tp


class FSDP2TensorParallelModel(TemplateModel):
    parallelize = fsdp2_tp


class SimpleCompiledModule(LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))

    def configure_model(self):
        self.model = torch.compile(self.model, backend="aot_eager")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _quiet(**kwargs):
    return {"accelerator": "cpu", "enable_progress_bar": False, "enable_model_summary": False, **kwargs}


# -- the cases (each the test of the same name) ---------------------------------------------------


def test_setup_device_mesh(tmp_path):
    from torch.distributed.device_mesh import DeviceMesh

    for dp_size, tp_size in ((1, 4), (4, 1), (2, 2)):
        trainer = Trainer(**_quiet(devices=4, strategy=Strategy(data_parallel_size=dp_size, tensor_parallel_size=tp_size),
                                   logger=False, enable_checkpointing=False, max_steps=1))

        class Model(BoringModel):
            def configure_model(self):
                mesh = self.device_mesh
                assert isinstance(mesh, DeviceMesh)
                assert mesh.device_type == self.device.type
                assert mesh.mesh_dim_names == ("data_parallel", "tensor_parallel"), mesh.mesh_dim_names
                assert (mesh.size(0), mesh.size(1), mesh.ndim) == (dp_size, tp_size, 2)

        trainer.fit(Model())

    trainer = Trainer(**_quiet(devices=4, num_nodes=1, logger=False, enable_checkpointing=False, max_steps=1,
                               strategy=Strategy(data_parallel_size="auto", tensor_parallel_size="auto")))

    class Auto(BoringModel):
        def configure_model(self):
            assert self.device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")
            assert (self.device_mesh.size(0), self.device_mesh.size(1)) == (1, 4)

    trainer.fit(Auto())


def _tensor_parallel(tmp_path, compile):
    from torch.distributed.tensor import DTensor

    class Model(TensorParallelModel):
        def on_train_start(self):
            mesh = self.device_mesh
            params = self.optimizers().param_groups[0]["params"]
            assert all(tensor.device_mesh == mesh["tensor_parallel"] for tensor in params)
            assert all(isinstance(weight, DTensor) for weight in self.model.parameters())
            assert self.model.w1.weight.device_mesh == mesh["tensor_parallel"]
            loader = self.trainer.train_dataloader
            assert len(loader) == 8 // loader.batch_size  # TP ranks see the same batches
            assert isinstance(loader.sampler, DistributedSampler)

        def training_step(self, batch):
            batches = self.all_gather(batch)
            assert all(torch.equal(batches[0], batches[i]) for i in range(1, len(batches)))
            return super().training_step(batch)

    trainer = Trainer(**_quiet(devices=2, strategy=Strategy(**TP_DEFAULT), max_steps=2, enable_checkpointing=False,
                               logger=False))
    seed_everything(0)
    with trainer.init_module(empty_init=True):
        model = Model(compile=compile)
    trainer.fit(model)


def test_tensor_parallel_compile(tmp_path):
    _tensor_parallel(tmp_path, True)


def test_tensor_parallel(tmp_path):
    _tensor_parallel(tmp_path, False)


def test_model_parallel_single_file_checkpoint_with_compile(tmp_path):
    seed_everything(0)
    strategy = Strategy(data_parallel_size=1, tensor_parallel_size=1, save_distributed_checkpoint=False)
    trainer = Trainer(**_quiet(devices=1, strategy=strategy, max_steps=2, limit_train_batches=2,
                               enable_checkpointing=False, logger=False, default_root_dir=tmp_path))
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g))
    with trainer.init_module(empty_init=True):
        model = SimpleCompiledModule()
    trainer.fit(model, DataLoader(data, batch_size=32))
    if trainer.is_global_zero:
        trainer.save_checkpoint(tmp_path / "compiled-model.ckpt")
    trainer.strategy.barrier()


def _fsdp2_tensor_parallel(tmp_path, compile):
    from torch.distributed.tensor import DTensor

    class Model(FSDP2TensorParallelModel):
        def on_train_start(self):
            params = self.optimizers().param_groups[0]["params"]
            assert all(isinstance(weight, DTensor) for weight in self.model.parameters())
            assert all(isinstance(tensor, DTensor) for tensor in params)
            mesh = self.model.w1.weight.device_mesh
            assert (mesh.ndim, mesh.size(0), mesh.size(1)) == (2, 2, 2)
            assert all(weight.device.type != "meta" for weight in self.model.parameters())
            assert all(tensor.device_mesh.ndim == 2 and tensor.device.type != "meta" for tensor in params)
            dp_mesh = self.device_mesh["data_parallel"]
            loader = self.trainer.train_dataloader
            assert len(loader) == 8 // loader.batch_size // dp_mesh.size()
            assert isinstance(loader.sampler, DistributedSampler)

        def training_step(self, batch):
            batches = self.all_gather(batch)
            same = batches[self.device_mesh["tensor_parallel"].mesh]
            assert all(torch.equal(same[0], same[i]) for i in range(1, len(same)))
            different = batches[self.device_mesh["data_parallel"].mesh]
            assert all(not torch.equal(different[0], different[i]) for i in range(1, len(different)))
            return super().training_step(batch)

    trainer = Trainer(**_quiet(devices=4, strategy=Strategy(data_parallel_size=2, tensor_parallel_size=2),
                               max_steps=2, enable_checkpointing=False, logger=False))
    seed_everything(0)
    with trainer.init_module(empty_init=True):
        model = Model(compile=compile)
    trainer.fit(model)


def test_fsdp2_tensor_parallel_compile(tmp_path):
    _fsdp2_tensor_parallel(tmp_path, True)


def test_fsdp2_tensor_parallel(tmp_path):
    _fsdp2_tensor_parallel(tmp_path, False)


def test_modules_without_parameters(tmp_path):
    from torchmetrics.classification import Accuracy

    class MetricsModel(TensorParallelModel):
        def __init__(self):
            super().__init__()
            self.metric = Accuracy("multiclass", num_classes=10)
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")

        def setup(self, stage) -> None:
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")

        def training_step(self, batch):
            assert self.metric.device.type == self.metric.tp.device.type == "cpu"
            self.metric(torch.rand(2, 10, device=self.device), torch.randint(0, 10, size=(2,), device=self.device))
            return super().training_step(batch)

    trainer = Trainer(**_quiet(default_root_dir=tmp_path, devices=2, strategy=Strategy(), max_steps=1,
                               enable_checkpointing=False, logger=False))
    trainer.fit(MetricsModel())


def _module_init_context(tmp_path, compile, precision, expected_dtype):
    class Model(FSDP2Model):
        def on_train_start(self):
            assert self.model.w1.weight.device == torch.device("cpu")
            assert self.model.w1.weight.dtype == expected_dtype
            assert self.optimizers(use_pl_optimizer=False).param_groups[0]["params"][0].device.type == "cpu"

    for empty_init, expected_device in ((False, torch.device("cpu")), (True, torch.device("meta"))):
        trainer = Trainer(**_quiet(default_root_dir=tmp_path, devices=2, strategy=Strategy(), precision=precision,
                                   max_steps=1, barebones=True, enable_checkpointing=False, logger=False))
        with trainer.init_module(empty_init=empty_init):
            model = Model(compile=compile)
        # On the CPU or the meta device until the strategy's setup.
        assert model.model.w1.weight.device == expected_device
        assert model.model.w1.weight.dtype == expected_dtype
        trainer.fit(model)


def _init_context_case(compile, precision, dtype):
    return lambda tmp_path: _module_init_context(tmp_path, compile, precision, dtype)


for _compile in (True, False):
    for _precision, _dtype in (("32-true", torch.float32), ("16-true", torch.float16), ("bf16-true", torch.bfloat16)):
        globals()[f"test_module_init_context_{_precision.replace('-', '_')}{'_compile' if _compile else ''}"] = (
            _init_context_case(_compile, _precision, _dtype))


def _strategy_state_dict(tmp_path, save_distributed_checkpoint):
    model = FSDP2Model()
    correct = model.state_dict()  # before any wrapping
    trainer = Trainer(**_quiet(default_root_dir=tmp_path, devices=2, max_epochs=1, barebones=True,
                               strategy=Strategy(save_distributed_checkpoint=save_distributed_checkpoint)))
    trainer.fit(model)
    state_dict = trainer.strategy.lightning_module_state_dict()
    if save_distributed_checkpoint or trainer.global_rank == 0:
        assert list(state_dict.keys()) == list(correct.keys()), (list(state_dict), list(correct))
    else:
        assert len(state_dict) == 0


def test_strategy_state_dict_distributed(tmp_path):
    _strategy_state_dict(tmp_path, True)


def test_strategy_state_dict_full(tmp_path):
    _strategy_state_dict(tmp_path, False)


def test_load_full_state_checkpoint_into_regular_model(tmp_path):
    model = FSDP2Model()
    trainer = Trainer(**_quiet(default_root_dir=tmp_path, devices=2, max_epochs=1, barebones=True,
                               strategy=Strategy(save_distributed_checkpoint=False)))
    trainer.fit(model)
    path = trainer.strategy.broadcast(tmp_path / "last.ckpt")
    trainer.save_checkpoint(path)
    model_state = trainer.strategy.lightning_module_state_dict()
    optimizer_state = trainer.strategy.optimizer_state(model.optimizers())
    if trainer.global_rank != 0:
        assert len(model_state) == 0 and len(optimizer_state) == 0

    model = TemplateModel()
    trainer = Trainer(**_quiet(default_root_dir=tmp_path, devices=2, strategy="ddp", max_epochs=1))
    trainer.fit(model, ckpt_path=path)
    restored_model = trainer.strategy.lightning_module_state_dict()
    restored_optimizer = trainer.strategy.optimizer_state(model.optimizers())
    if trainer.global_rank == 0:
        assert len(model_state) == len(restored_model) and len(optimizer_state) == len(restored_optimizer)
        torch.testing.assert_close(model_state, restored_model, atol=0, rtol=0)
        torch.testing.assert_close(optimizer_state, restored_optimizer, atol=0, rtol=0)
    trainer.strategy.barrier()


def test_load_standard_checkpoint_into_distributed_model(tmp_path):
    model = TemplateModel()
    trainer = Trainer(**_quiet(default_root_dir=tmp_path, devices=2, strategy="ddp", max_epochs=1))
    trainer.fit(model)
    path = trainer.strategy.broadcast(tmp_path / "last.ckpt")
    trainer.save_checkpoint(path)
    model_state = trainer.strategy.lightning_module_state_dict()
    optimizer_state = trainer.strategy.optimizer_state(model.optimizers())

    model = FSDP2Model()
    trainer = Trainer(**_quiet(default_root_dir=tmp_path, devices=2, max_epochs=1, barebones=True,
                               strategy=Strategy(save_distributed_checkpoint=False)))
    trainer.fit(model, ckpt_path=path)
    restored_model = trainer.strategy.lightning_module_state_dict()
    restored_optimizer = trainer.strategy.optimizer_state(model.optimizers())
    if trainer.global_rank != 0:
        assert len(restored_model) == 0 and len(restored_optimizer) == 0
    else:
        assert len(model_state) == len(restored_model) and len(optimizer_state) == len(restored_optimizer)
        torch.testing.assert_close(model_state, restored_model, atol=0, rtol=0)
        torch.testing.assert_close(optimizer_state, restored_optimizer, atol=0, rtol=0)
    trainer.strategy.barrier()


def test_save_load_sharded_state_dict(tmp_path):
    class CheckpointModel(FSDP2Model):
        def __init__(self, params_to_compare=None):
            super().__init__()
            self.params_to_compare = params_to_compare

        def on_train_start(self):
            if self.params_to_compare is not None:
                for p0, p1 in zip(self.params_to_compare, self.trainer.model.parameters()):
                    assert torch.equal(p0, p1.full_tensor())

    seed_everything(0)
    kwargs = _quiet(default_root_dir=tmp_path, devices=2, max_epochs=1, logger=False)
    model = CheckpointModel()
    trainer = Trainer(**kwargs, strategy=Strategy(save_distributed_checkpoint=True))
    trainer.fit(model)
    params_before = [p.full_tensor() for p in trainer.model.parameters()]

    path = Path(trainer.strategy.broadcast(trainer.checkpoint_callback.best_model_path))
    files = set(os.listdir(path))
    assert files == {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"}, files  # (Lightning's exact set)
    metadata = torch.load(path / "meta.pt", weights_only=True)
    assert "pytorch-lightning_version" in metadata
    assert len(metadata["callbacks"]) == 1
    assert "state_dict" not in metadata and "optimizer_states" not in metadata

    model = CheckpointModel(params_to_compare=params_before)
    trainer = Trainer(**{**kwargs, "max_epochs": 2}, strategy=Strategy(save_distributed_checkpoint=True))
    trainer.fit(model, ckpt_path=path)


# -- ours: a project switching strategies resumes in both directions -----------------------------


def _fit_params(strategy, tmp_path, max_epochs: int, ckpt_path=None) -> list[torch.Tensor]:
    """FSDP2Model (FSDP over data_parallel, applied by the module) for ``max_epochs`` (2 steps each
    on 2 ranks); Lightning's ModelCheckpoint saves at each epoch's end. The parameters after fit."""
    seed_everything(0)
    trainer = Trainer(**_quiet(default_root_dir=tmp_path, devices=2, max_epochs=max_epochs, logger=False,
                               strategy=strategy))
    # (data of its own generator: TitanStrategy restores the RNG states it saved, Lightning's do not)
    data = DataLoader(torch.randn(8, 32, generator=torch.Generator().manual_seed(1)), batch_size=2)
    trainer.fit(FSDP2Model(), data, ckpt_path=ckpt_path)
    return [p.full_tensor() for p in trainer.model.parameters()], trainer


def _cross(tmp_path, first, second) -> None:
    """Train one epoch with ``first``, resume for a second with ``second`` and with ``first``: the same
    parameters (a switch of strategy mid-project continues exactly)."""
    _, trainer = _fit_params(first(), tmp_path / "first", 1)
    path = Path(trainer.strategy.broadcast(trainer.checkpoint_callback.best_model_path))
    switched, trainer = _fit_params(second(), tmp_path / "switched", 2, ckpt_path=path)
    assert trainer.global_step == 4
    same, _ = _fit_params(first(), tmp_path / "same", 2, ckpt_path=path)
    for a, b in zip(switched, same, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _sizes(cls):
    return lambda: cls(data_parallel_size=2, tensor_parallel_size=1)


def cross_model_parallel_checkpoint_resumes_under_titan(tmp_path):
    _cross(tmp_path, _sizes(ModelParallelStrategy), _sizes(TitanStrategy))


def cross_titan_checkpoint_resumes_under_model_parallel(tmp_path):
    _cross(tmp_path, _sizes(TitanStrategy), _sizes(ModelParallelStrategy))


# -- runner -----------------------------------------------------------------------------------------


def cases() -> list[str]:
    """Lightning's."""
    return sorted(name for name in globals() if name.startswith("test_"))


def crossing_cases() -> list[str]:
    """Ours: checkpoints crossing between ModelParallelStrategy and TitanStrategy."""
    return sorted(name for name in globals() if name.startswith("cross_"))


def main(argv: list[str]) -> None:
    global Strategy

    out, names = Path(argv[1]), argv[4:]
    Strategy = {"titan": TitanStrategy, "mps": ModelParallelStrategy}[argv[3]]
    TP_DEFAULT.update({"tensor_parallel_size": "auto"} if Strategy is TitanStrategy else {})
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    results = {}
    for name in names:
        folder = out / "cases" / name
        folder.mkdir(parents=True, exist_ok=True)
        try:
            globals()[name](folder)
            results[name] = "passed"
        except BaseException:
            results[name] = traceback.format_exc()
            print(results[name], file=sys.stderr, flush=True)
        (out / f"rank{rank}.json.partial").write_text(json.dumps({"rank": rank, "results": results}))
        (out / f"rank{rank}.json.partial").replace(out / f"rank{rank}.json")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
