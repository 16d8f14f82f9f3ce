"""FakePGStrategy: one process simulates a world size; same mesh, same parallelisms."""

import math

import lightning as L
import pytest
import torch
import torch.distributed as dist

from recipes.tests import features
from titan_lightning.config import ConfigError
from titan_lightning.strategies import FakePGStrategy
from titan_lightning.testing.record import RecordSteps
from titan_lightning.trainer import RUN_DIR_ENV, build_trainer


@pytest.fixture(autouse=True)
def run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    yield
    if dist.is_initialized():  # a failed run may leave its group behind
        dist.destroy_process_group()


def fake_fit(recipe, world_size, *, rank=0, steps=1, **degrees):
    run = recipe()
    for name, value in degrees.items():
        setattr(run.job.parallelism, name, value)
    p = run.job.parallelism
    dp = p.dp_replicate * (p.dp_shard if p.dp_shard > 0 else world_size // (p.dp_replicate * p.tp))
    # Keep one sequence per data-parallel rank whatever the simulated size.
    run.job.training.tokens_per_microbatch_per_dp_rank = run.job.training.seq_len
    strategy = FakePGStrategy(world_size=world_size, rank=rank)
    record = RecordSteps()
    run.trainer.update(max_steps=steps, accelerator="cpu", devices=1, strategy=strategy)
    run.trainer["callbacks"] = [*run.trainer.get("callbacks", []), record]
    trainer = build_trainer(run)
    trainer.fit(run.module, datamodule=run.datamodule)
    strategy.losses = record.losses
    return strategy, trainer, dp


# (degrees, world sizes)
LAYOUTS = {
    "fsdp": dict(dp_shard=-1),
    "ddp": dict(dp_replicate=-1, dp_shard=1),
    "hsdp": dict(dp_replicate=2, dp_shard=-1),
    "tp": dict(dp_shard=1, tp=-1),
    "tp_no_sp": dict(dp_shard=1, tp=-1, sequence_parallel=False),
    "fsdp_tp": dict(dp_shard=-1, tp=2),
    "hsdp_tp": dict(dp_replicate=2, dp_shard=-1, tp=2),
}


def _degrees(layout: str, world_size: int) -> dict:
    degrees = dict(LAYOUTS[layout])
    if degrees.get("dp_replicate") == -1:
        degrees["dp_replicate"] = world_size
    if degrees.get("tp") == -1:
        degrees["tp"] = min(world_size, 16)  # the debug model has 16 heads
        if degrees["tp"] < world_size:
            degrees["dp_shard"] = world_size // 16
    return degrees


@pytest.mark.parametrize("world_size", [8, 64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_runs_at_simulated_world_size(layout, world_size, capsys):
    strategy, trainer, _ = fake_fit(features.llama3_debugmodel, world_size, **_degrees(layout, world_size))
    assert trainer.global_step == 1
    assert strategy.dims.world_size == world_size
    assert strategy.memory["parameters"] > 0 and strategy.memory["optimizer_state"] > 0
    assert f"[fake_pg] world_size={world_size} rank=0" in capsys.readouterr().out
    assert not dist.is_initialized()  # torn down


def test_memory_per_rank_shrinks_with_dp_shard():
    memory = {}
    for world_size in (2, 8, 32):
        strategy, _, _ = fake_fit(features.llama3_debugmodel, world_size, dp_shard=-1)
        memory[world_size] = strategy.memory
    for kind in ("parameters", "gradients", "optimizer_state"):
        assert memory[2][kind] > memory[8][kind] > memory[32][kind], kind
        # Sharded tensors shrink about linearly (norm weights are tiny, padding is per shard).
        assert memory[2][kind] / memory[8][kind] == pytest.approx(4, rel=0.05), kind


def test_simulated_rank_is_selectable_and_sees_its_data_shard():
    seen = {}

    def record(run):
        class Seen(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                seen["sampler"] = trainer.distributed_sampler_kwargs
                seen["input_ids"] = batch["input_ids"].clone()
        run.trainer["callbacks"] = [Seen()]
        return run

    strategy, _, _ = fake_fit(lambda: record(features.llama3_debugmodel()), 4, rank=3, dp_shard=4)
    assert strategy.global_rank == 3
    assert seen["sampler"] == {"num_replicas": 4, "rank": 3}
    rank3_batch = seen["input_ids"]
    fake_fit(lambda: record(features.llama3_debugmodel()), 4, rank=0, dp_shard=4)
    assert seen["sampler"] == {"num_replicas": 4, "rank": 0}
    assert not torch.equal(seen["input_ids"], rank3_batch)


def test_fake_pg_refuses_checkpointing():
    run = features.llama3_debugmodel()
    run.trainer.update(enable_checkpointing=True, max_steps=1, strategy=FakePGStrategy(world_size=2), accelerator="cpu", devices=1)
    run.job.parallelism.dp_shard = 2
    run.job.training.tokens_per_microbatch_per_dp_rank = 128
    trainer = build_trainer(run)
    with pytest.raises(ConfigError, match="checkpointing cannot run under the fake process group"):
        trainer.fit(run.module, datamodule=run.datamodule)


def test_fake_pg_refuses_pipeline_parallel_before_work():
    with pytest.raises(ConfigError, match=r"parallelism.pp=2: pipeline parallelism cannot run under the fake process group"):
        L.Trainer(strategy=FakePGStrategy(world_size=2, pp=2, dp_shard=1), accelerator="cpu", devices=1, logger=False)


def test_bad_rank_or_world_size():
    with pytest.raises(ValueError, match=r"FakePGStrategy\(rank=4\) must be in \[0, world_size=4\)"):
        FakePGStrategy(world_size=4, rank=4)
    with pytest.raises(ValueError, match=r"FakePGStrategy\(world_size=0\) must be >= 1"):
        FakePGStrategy(world_size=0)


def test_registry_name_simulates_devices_times_nodes():
    trainer = L.Trainer(strategy="fake_pg", accelerator="cpu", devices=8, logger=False)
    assert isinstance(trainer.strategy, FakePGStrategy)
    assert trainer.strategy.world_size == 8
    assert trainer.strategy.launcher is None


def test_reduce_scatter_under_fake_pg_is_deterministic():
    """torch's fake group leaves reduce-scatter outputs unwritten; ours write this rank's chunk."""
    from torch.distributed import _functional_collectives as funcol

    from titan_lightning.parallel.fake import deterministic_collectives, init_fake_process_group

    init_fake_process_group(rank=1, world_size=4)
    original = dist.reduce_scatter_tensor
    data = torch.arange(8.0)
    with deterministic_collectives():
        out = torch.full((2,), float("nan"))
        dist.reduce_scatter_tensor(out, data, op=dist.ReduceOp.SUM)
        assert out.tolist() == [8.0, 12.0]  # chunk 1 = [2, 3], as if 4 ranks held it
        group = dist.group.WORLD
        functional = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
        assert funcol.wait_tensor(functional(data, "avg", 0, group)).tolist() == [2.0, 3.0]
    assert dist.reduce_scatter_tensor is original  # restored on exit


def test_all_gather_under_fake_pg_repeats_this_ranks_input():
    """torch's fake group leaves all-gather outputs unwritten (allocator garbage); ours repeat the input."""
    from torch.distributed import _functional_collectives as funcol

    from titan_lightning.parallel.fake import deterministic_collectives, init_fake_process_group

    init_fake_process_group(rank=2, world_size=3)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    functional = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    with deterministic_collectives():
        out = torch.full((6,), float("nan"))
        slot = out[4:]  # FSDP2 passes a view of its own slot as the input
        slot.copy_(torch.tensor([5.0, 6.0]))
        gather(out, slot)
        assert out.tolist() == [5.0, 6.0] * 3
        x = torch.tensor([[1.0, 2.0]])
        assert funcol.wait_tensor(functional(x, 0, dist.group.WORLD)).tolist() == [[1.0, 2.0]] * 3
        assert funcol.wait_tensor(functional(x, 1, dist.group.WORLD)).tolist() == [[1.0, 2.0] * 3]


def test_fake_runs_are_bitwise_reproducible():
    first, _, _ = fake_fit(features.llama3_debugmodel, 8, steps=2, dp_shard=4, tp=2)
    second, _, _ = fake_fit(features.llama3_debugmodel, 8, steps=2, dp_shard=4, tp=2)
    assert first.memory == second.memory
    assert first.losses == second.losses and all(map(math.isfinite, first.losses))


def test_a_simulated_rank_is_put_back_after_fit():
    """FakePGStrategy(rank=r) makes this process rank r for Lightning's rank-zero-only logging;
    after fit the process is rank 0 again (else a later Trainer here writes no logs)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    run = features.llama3_debugmodel()
    run.trainer.update(strategy=FakePGStrategy(world_size=4, rank=3), accelerator="cpu", devices=1, max_steps=1)
    trainer = build_trainer(run)
    seen = []

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append(rank_zero_only.rank)

    trainer.callbacks.append(Probe())
    trainer.fit(run.module, datamodule=run.datamodule)
    assert seen == [3]
    assert rank_zero_only.rank == 0
