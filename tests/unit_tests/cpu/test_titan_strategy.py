"""TitanStrategy's contract without real process groups: errors before launch, registry, mesh."""

import lightning as L
import pytest
import torch
import torch.distributed as dist

from recipes.tests import features
from titan_lightning import cli
from titan_lightning.config import ConfigError, ParallelismConfig
from titan_lightning.models.qwen3 import Qwen3Job, Qwen3Module, qwen3_args
from titan_lightning.parallel.contracts import (Blocks, ContractError, CPAttention, GroupedExperts, MoELayer,
                                                PipelineModel, TitanModule, TitanStrategyView,
                                                check_contracts, expert_modules, moe_layers)
from titan_lightning.parallel.pipeline import PipelinePlan
from titan_lightning.strategies import FakePGStrategy, FSDP2Strategy, TensorParallelStrategy, TitanStrategy
from titan_lightning.trainer import RUN_DIR_ENV, build_trainer
from user_module import UserModule


@pytest.fixture(autouse=True)
def clean(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    monkeypatch.chdir(tmp_path)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _trainer(strategy, devices=1, **kwargs):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def test_degrees_that_do_not_fit_the_world_fail_in_the_trainer_before_any_spawn():
    with pytest.raises(ConfigError, match=r"dp_replicate\*dp_shard\*tp\*pp\*cp = 1\*3\*1\*1\*1 = 3 must equal the world size 2"):
        _trainer(TitanStrategy(dp_shard=3), devices=2)


def test_negative_degree_other_than_dp_shard_is_refused():
    with pytest.raises(ValueError, match=r"parallelism.tp=-1 must be an integer >= 1"):
        TitanStrategy(tp=-1)


def test_unknown_reshard_policy_is_refused():
    with pytest.raises(ValueError, match=r"parallelism.fsdp_reshard_after_forward='sometimes' is not one of default, always, never"):
        FSDP2Strategy(fsdp_reshard_after_forward="sometimes")


def test_pipeline_settings_are_refused_before_spawn():
    with pytest.raises(ConfigError, match=r"pp_microbatches=1 must be >= parallelism.pp=2 for the 1F1B schedule"):
        _trainer(TitanStrategy(dp_shard=1, pp=2), devices=2)
    with pytest.raises(ConfigError, match=r"pp_schedule='Interleaved1F1B' is a looped schedule"):
        _trainer(TitanStrategy(dp_shard=1, pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=1,
                               pp_microbatches=2), devices=2)


def test_tp_that_does_not_divide_the_heads_fails_on_the_command_line(capsys):
    argv = ["fit", "--recipe", "recipes.tests.features:llama3_tp2", "--trainer.devices", "3",
            "--trainer.accelerator", "cpu", "--job.parallelism.tp", "3"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "model.n_heads=16 must be divisible by parallelism.tp=3" in err
    assert err.count("\n") == 1


def test_strategy_degrees_must_agree_with_the_job():
    run = features.llama3_fsdp4()
    run.trainer.update(strategy=FakePGStrategy(world_size=4, dp_shard=2, tp=2), accelerator="cpu", devices=1)
    with pytest.raises(ConfigError, match=r"set the degrees in one place \(the job\)"):
        build_trainer(run)


def test_registry_aliases():
    assert type(_trainer("titan").strategy) is TitanStrategy
    assert type(_trainer("fsdp2").strategy) is FSDP2Strategy
    assert type(_trainer("fake_pg", devices=4).strategy) is FakePGStrategy
    tp = _trainer("tensor_parallel", devices=4).strategy
    assert type(tp) is TensorParallelStrategy
    assert tp.default_parallelism().tp == 4 and tp.default_parallelism().dp_shard == 1


def test_single_parallelism_strategies_refuse_other_degrees():
    run = features.llama3_fsdp2_tp2()
    run.trainer.update(strategy=FSDP2Strategy(), accelerator="cpu", devices=4)
    with pytest.raises(ConfigError, match=r"FSDP2Strategy does not apply parallelism.tp=2; use TitanStrategy"):
        build_trainer(run)


def test_tp_on_a_module_without_a_plan_says_how_to_declare_one():
    trainer = _trainer(FakePGStrategy(world_size=2, dp_shard=1, tp=2), max_steps=1)
    with pytest.raises(ConfigError, match=r"parallelism.tp=2 needs a tensor-parallel plan, and UserModule declares none: give it a `tp_plan`"):
        trainer.fit(UserModule(batch_size=4))


def test_module_sees_the_named_mesh_and_its_data_parallel_rank():
    seen = {}

    class Look(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["dims"] = pl_module.device_mesh.mesh_dim_names
            seen["sampler"] = trainer.distributed_sampler_kwargs

    run = features.llama3_hsdp2x2_tp2()
    run.job.training.tokens_per_microbatch_per_dp_rank = run.job.training.seq_len
    run.trainer.update(strategy=FakePGStrategy(world_size=8, rank=5), accelerator="cpu", devices=1, max_steps=1,
                       callbacks=[Look()])
    trainer = build_trainer(run)
    trainer.fit(run.module, datamodule=run.datamodule)
    assert seen["dims"] == ("dp_replicate", "dp_shard", "tp")
    # rank 5 = (replicate 1, shard 0, tp 1): data-parallel rank 2 of 4; TP ranks share it.
    assert seen["sampler"] == {"num_replicas": 4, "rank": 2}


def test_a_user_module_without_what_cp_or_ep_shard_fails_where_the_strategy_first_sees_it():
    # check_module runs before any process group or mesh: the one line names the missing part.
    for degrees, message in (({"dp_shard": 1, "cp": 2}, r"parallelism.cp=2: UserModule has no attention module that can do CP"),
                             ({"dp_shard": 2, "ep": 2}, r"parallelism.ep=2: UserModule has no MoE layer to shard")):
        strategy = FakePGStrategy(world_size=2, **degrees)
        _trainer(strategy, max_steps=1)
        with pytest.raises(ContractError, match=message):
            strategy.check_module(UserModule(batch_size=4))
        assert not dist.is_initialized()


def test_a_pipeline_plan_is_checked_against_a_built_network_before_launch():
    module = UserModule(batch_size=4)
    module.net = module  # (the plan's model: the module itself; its blocks are an nn.ModuleList)
    module.pipeline_plan = PipelinePlan(model="net", layers="blocks", first=("embed",), last=("head",))
    with pytest.raises(ContractError, match=r"needs UserModule.blocks to be an nn.ModuleDict of blocks \(found ModuleList\)"):
        check_contracts(module, ParallelismConfig(pp=2, dp_shard=1), built=True)
    module.blocks = torch.nn.ModuleDict({str(i): block for i, block in enumerate(module.blocks)})
    module.pipeline_plan = PipelinePlan(model="net", layers="blocks", first=("embed",), last=("norm", "head"))
    with pytest.raises(ContractError, match=r"pipeline plan names UserModule.norm, which does not exist"):
        check_contracts(module, ParallelismConfig(pp=2, dp_shard=1), built=True)
    check_contracts(module, ParallelismConfig(pp=2, dp_shard=1), built=False)  # (built at setup: checked there)
    del module.pipeline_plan
    with pytest.raises(ContractError, match=r"parallelism.pp=2 needs a pipeline plan, and UserModule declares none"):
        check_contracts(module, ParallelismConfig(pp=2, dp_shard=1), built=False)


def test_our_decoders_meet_the_declared_contracts():
    with torch.device("meta"):
        dense = features.llama3_small().module.build_model()
        moe = Qwen3Module(Qwen3Job(model=qwen3_args("debugmodel_moe"))).build_model()
    for model in (dense, moe):
        assert isinstance(model, Blocks) and isinstance(model, PipelineModel)
        assert len([m for m in model.modules() if isinstance(m, CPAttention)]) == len(model.layers)
        assert all(hasattr(model, name) for name in (*PipelinePlan().first, *PipelinePlan().last))
    assert moe_layers(moe) and all(isinstance(m, MoELayer) for m in moe_layers(moe))
    assert all(isinstance(m, GroupedExperts) for m in expert_modules(moe, 2))
    assert isinstance(TitanStrategy(), TitanStrategyView)
    assert isinstance(features.llama3_small().module, TitanModule)
