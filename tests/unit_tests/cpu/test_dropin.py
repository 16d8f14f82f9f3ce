"""Existing Lightning code under TitanStrategy: modules written without this project (and for
Lightning's ModelParallelStrategy) train on 2-4 gloo ranks and match one process, loss and
gradient norm within 1e-5 at each of 5 steps. The modules and recipes: lightning_styles.py.

Multi-process tests start one process per rank through titan_lightning.testing.launch, each with
a hard timeout. The in-process tests check what needs no ranks (constructor keywords, mesh names).
"""

from pathlib import Path

import pytest
import torch

from titan_lightning.testing.launch import launch, pythonpath_env

HERE = Path(__file__).parent
ENV = pythonpath_env(HERE)
TIMEOUT = 300


def _fit(recipe: str, world_size: int, out: Path, **env) -> list[dict]:
    argv = ["fit", "--recipe", f"lightning_styles:{recipe}", "--trainer.devices", str(world_size)]
    return launch(argv, world_size, out_dir=out, timeout=TIMEOUT, env={**ENV, **env}).ranks


def _assert_matches(ranks: list[dict], reference: dict, steps: int = 5, numbers=("losses", "grad_norms")) -> None:
    for rank in ranks:
        assert rank["steps"] == reference["steps"] and len(rank["steps"]) == steps
        for what in numbers:
            for got, want in zip(rank[what], reference[what], strict=True):
                assert abs(got - want) <= 1e-5 * max(abs(want), 1e-12), (what, rank[what], reference[what])


@pytest.fixture(scope="module")
def submodule_reference(tmp_path_factory):
    """One process, 5 steps; Lightning's ModelCheckpoint saves a full checkpoint at step 3."""
    out = tmp_path_factory.mktemp("submodule_single")
    (rank,) = _fit("submodule_single", 1, out, STYLES_CHECKPOINTS=str(out / "ckpt"))
    return rank, out / "ckpt" / "epoch=0-step=3.ckpt"


@pytest.mark.multi_process
@pytest.mark.parametrize("recipe", ["submodule_titan_fsdp2", "submodule_ddp", "manual_fsdp2", "submodule_accumulate_fsdp2"])
def test_training_step_calling_a_submodule_matches_one_process(recipe, submodule_reference, tmp_path):
    """``self.model(x)`` in training_step and validation_step: the LightningModule's forward never
    runs. Also with manual optimization (backward and step inside training_step) and with
    gradient accumulation."""
    reference, _ = submodule_reference
    ranks = _fit(recipe, 2, tmp_path)
    # Under accumulation the logged loss is, as under Lightning's strategies, the step's last microbatch's
    # (test_lightning_semantics.py), which one process with the whole batch does not compute: the steps
    # are compared by their gradients.
    _assert_matches(ranks, reference, numbers=("grad_norms",) if recipe == "submodule_accumulate_fsdp2" else
                    ("losses", "grad_norms"))
    for rank in ranks if recipe != "submodule_accumulate_fsdp2" else []:  # (validation at step 3; smaller batches there)
        assert abs(rank["metrics"]["val/loss"] - reference["metrics"]["val/loss"]) <= 1e-5 * reference["metrics"]["val/loss"]


@pytest.mark.multi_process
def test_two_submodules_and_a_parameter_of_the_module_itself_match_one_process(tmp_path):
    (reference,) = _fit("two_part_single", 1, tmp_path / "single")
    _assert_matches(_fit("two_part_titan_fsdp2", 2, tmp_path / "fsdp2"), reference)


@pytest.mark.multi_process
@pytest.mark.slow
def test_model_parallel_strategy_code_with_only_the_class_name_changed(tmp_path):
    """Lightning's TP + FSDP2 pattern: configure_model parallelizes through
    device_mesh["tensor_parallel"] / ["data_parallel"], the module enters loss_parallel() in
    training_step and backward (nested in the strategy's); 2 x 2 ranks against one process."""
    (reference,) = _fit("mps_single", 1, tmp_path / "single")
    _assert_matches(_fit("mps_dp2_tp2", 4, tmp_path / "dp2_tp2"), reference)


@pytest.mark.multi_process
@pytest.mark.slow
def test_full_checkpoint_loads_into_a_plain_module_and_resumes_on_another_world_size(submodule_reference, tmp_path):
    """save_distributed_checkpoint=False: one file, the same as one process saves, loadable by
    plain torch; two ranks resume from it exactly as one process does."""
    from lightning_styles import Net

    reference, single_file = submodule_reference
    ranks = _fit("submodule_fsdp2_full_checkpoint", 2, tmp_path / "fsdp2", STYLES_CHECKPOINTS=str(tmp_path / "ckpt"))
    _assert_matches(ranks, reference)
    # (saved at the end of the first epoch, step 3, as in the single process)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted(p.name for p in single_file.parent.iterdir())
    file = tmp_path / "ckpt" / single_file.name
    assert file.is_file()

    saved, expected = (torch.load(f, map_location="cpu", weights_only=True) for f in (file, single_file))
    net = Net()
    net.load_state_dict({k.removeprefix("model."): v for k, v in saved["state_dict"].items()}, strict=True)
    for name, value in expected["state_dict"].items():
        torch.testing.assert_close(saved["state_dict"][name], value, rtol=1e-5, atol=1e-6)
    # A plain torch optimizer takes the optimizer state as it is (parameter indices).
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    optimizer.load_state_dict(saved["optimizer_states"][0])
    assert optimizer.state_dict()["state"][0]["step"].item() == 3

    (resumed_single,) = _fit("submodule_resume_single", 1, tmp_path / "resume1", STYLES_RESUME=str(single_file))
    assert resumed_single["steps"] == [4, 5]
    _assert_matches(_fit("submodule_resume", 2, tmp_path / "resume2", STYLES_RESUME=str(file)), resumed_single, steps=2)


@pytest.mark.multi_process
def test_sharded_checkpoint_is_a_folder_by_default(tmp_path):
    _fit("submodule_titan_fsdp2", 2, tmp_path, STYLES_CHECKPOINTS=str(tmp_path / "ckpt"))
    folder = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    assert folder.is_dir() and {p.name for p in folder.iterdir()} == {".metadata", "meta.pt", "__0_0.distcp",
                                                                      "__1_0.distcp"}  # (Lightning's file set)


# -- in process ---------------------------------------------------------------------------------


def test_model_parallel_strategy_keywords_and_defaults():
    import lightning as L

    from titan_lightning.config import ConfigError
    from titan_lightning.strategies import TitanStrategy

    strategy = TitanStrategy(data_parallel_size=2, tensor_parallel_size="auto", save_distributed_checkpoint=False,
                             process_group_backend="gloo")
    L.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=2, logger=False)
    # "auto": tensor parallel over the devices of a node, data parallel over the nodes.
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (2, 2)
    assert (strategy._parallelism.dp_shard, strategy._parallelism.tp) == (2, 2)
    assert strategy.process_group_backend == "gloo" and strategy._save_distributed_checkpoint is False
    auto = TitanStrategy(data_parallel_size="auto")
    L.Trainer(strategy=auto, accelerator="cpu", devices=4, logger=False)
    assert (auto._parallelism.dp_shard, auto._parallelism.tp) == (1, 4)
    with pytest.raises(ConfigError, match=r"data_parallel_size=3.*3 \* 2 = 6; the sizes multiplied should equal the "
                                          r"world size 4") as sizes:
        L.Trainer(strategy=TitanStrategy(data_parallel_size=3, tensor_parallel_size=2), accelerator="cpu", devices=4)
    assert isinstance(sizes.value, RuntimeError)  # (ModelParallelStrategy's type too)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0\): expected a positive int or 'auto'"):
        TitanStrategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"either ModelParallelStrategy's data_parallel_size/tensor_parallel_size or its own degrees \(tp\)"):
        TitanStrategy(data_parallel_size=2, tp=2)


def test_mesh_has_lightning_names_next_to_ours():
    import lightning as L
    from user_module import UserModule

    from titan_lightning.strategies import FakePGStrategy

    seen = {}

    class Look(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            mesh = pl_module.device_mesh
            seen.update(names=mesh.mesh_dim_names, dp=mesh["data_parallel"].size(), tp=mesh["tensor_parallel"].size(),
                        sampler=trainer.distributed_sampler_kwargs)

    trainer = L.Trainer(strategy=FakePGStrategy(world_size=4, dp_replicate=2, dp_shard=2, rank=3), accelerator="cpu",
                        devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Look()])
    trainer.fit(UserModule(batch_size=4))
    # tp has degree 1 and is still a (size-1) dim, so device_mesh["tensor_parallel"] exists.
    assert seen == {"names": ("dp_replicate", "dp_shard", "tp"), "dp": 4, "tp": 1,
                    "sampler": {"num_replicas": 4, "rank": 3}}


# -- the network called outside the step hooks -------------------------------------------------


def _outside(world_size: int, out: Path, module: str = "submodule") -> dict:
    from titan_lightning.testing.spawn import run_function

    values = run_function("outside_calls_cases:evaluate_outside_steps", world_size, out_dir=out, timeout=TIMEOUT,
                          env=ENV, init_process_group=False, out=str(out / "run"), module=module)
    for rank_values in values[1:]:  # every rank computes the same numbers
        assert rank_values == values[0]
    return values[0]


def _assert_close(got, want, path=""):
    if isinstance(want, dict):
        assert set(got) == set(want), (path, sorted(set(got) ^ set(want)))
        for key in want:
            _assert_close(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_close(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert abs(got - want) <= 1e-5 * abs(want) + 1e-6, (path, got, want)
    else:
        assert got == want, (path, got, want)


@pytest.fixture(scope="module")
def outside_reference(tmp_path_factory):
    return {module: _outside(1, tmp_path_factory.mktemp(f"outside_{module}"), module)
            for module in ("submodule", "two_part")}


@pytest.mark.multi_process
@pytest.mark.parametrize("world_size,module", [(2, "submodule"), (4, "submodule"), (2, "two_part")])
def test_the_network_called_outside_the_step_hooks_matches_one_process(world_size, module, outside_reference,
                                                                      tmp_path):
    """In on_validation_epoch_end, on_train_end, a callback's on_train_batch_end and the user's script
    after fit (no_grad, and a backward for input gradients), then state dict, full_tensor, save and a
    second validate: the same numbers as one process, and every parameter sharded again after each."""
    values = _outside(world_size, tmp_path, module)
    sharded = {key: values.pop(key) for key in list(values) if key.endswith("_sharded")}
    assert sharded and all(sharded.values()), sharded
    _assert_close(values, outside_reference[module])
