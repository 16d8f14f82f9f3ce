"""Expert parallelism: dispatch/combine against the unsharded MoE, on thread ranks with real exchange."""

import pytest
import torch

from ep_cases import ep_matches_one_process
from titan_lightning.parallel.expert import _expert_major_order
from titan_lightning.testing.threaded import run_threaded


def test_expert_major_order_regroups_rank_major_rows():
    # 2 ranks x 2 local experts; rows arrive (rank0: e0 x1, e1 x2), (rank1: e0 x0, e1 x3)
    order = _expert_major_order([[1, 2], [0, 3]], torch.device("cpu"))
    assert order.tolist() == [0, 1, 2, 3, 4, 5]
    order = _expert_major_order([[2, 1], [1, 2]], torch.device("cpu"))
    assert order.tolist() == [0, 1, 3, 2, 4, 5]  # e0: r0 rows 0-1, r1 row 3; e1: r0 row 2, r1 rows 4-5


@pytest.mark.parametrize("dispatch", ["splits", "padded"])
@pytest.mark.parametrize("ep, fields", [(2, {}), (4, {}), (2, dict(top_k=3, score_before_experts=True)),
                                        (4, dict(score_func="sigmoid", route_norm=True, num_shared_experts=0))])
def test_ep_output_and_gradients_equal_the_unsharded_moe(ep, fields, dispatch):
    for rank, errors in enumerate(run_threaded(ep_matches_one_process, ep, dispatch=dispatch, **fields)):
        assert errors["local_experts"] == 8 // ep
        for name in ("out", "dx", "gate", "w1"):
            assert errors[name] < 1e-12, f"rank {rank}: {name} differs by {errors[name]:.2e}"


@pytest.mark.parametrize("dispatch", ["splits", "padded"])
def test_dispatch_then_combine_is_the_identity_for_uneven_counts(dispatch):
    from ep_cases import round_trip

    results = run_threaded(round_trip, 3, dispatch=dispatch)
    assert all(r["equal"] for r in results)
    if dispatch == "splits":
        # rank 1 holds experts 2, 3 and gets (r + 1) * (e % 3) tokens for each from every rank r
        assert results[1]["received"] == (sum((r + 1) * (2 + 0) for r in range(3)), [6 * 2, 0])
    else:
        # rank 1 holds experts 2, 3 and gets 3 * ((e + r) % 3) tokens for each from every rank r
        assert results[1]["received"] == (18, [3 * (2 + 0 + 1), 3 * (0 + 1 + 2)])


def test_expert_parallel_strategy_spreads_experts_over_every_rank_and_checks_before_spawn():
    import lightning as L

    from titan_lightning import ExpertParallelStrategy
    from titan_lightning.config import ConfigError

    def trainer(strategy, devices):
        return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    strategy = trainer(ExpertParallelStrategy(), 4).strategy
    assert (strategy.default_parallelism().ep, strategy.default_parallelism().dp_shard) == (4, -1)
    assert trainer("expert_parallel", 2).strategy.default_parallelism().ep == 2  # registry name
    with pytest.raises(ConfigError, match=r"parallelism.ep=3 must divide dp_shard\*cp\*tp = 4\*1\*1 = 4"):
        trainer(ExpertParallelStrategy(ep=3), 4)


def test_ep_and_moe_settings_are_validated_by_name():
    from recipes.tests import models
    from titan_lightning.config import ConfigError, validate_job

    def check(run, message, world):
        with pytest.raises(ConfigError, match=message):
            validate_job(run.job, world_size=world)

    dense = models.qwen3_debugmodel()
    dense.job.parallelism.dp_shard, dense.job.parallelism.ep = 2, 2
    check(dense, r"parallelism.ep=2 needs a mixture-of-experts model, and model.moe is None", 2)
    moe = models.qwen3_moe_debugmodel()
    moe.job.parallelism.dp_shard, moe.job.parallelism.tp = 1, 2
    moe.job.model.moe.hidden_dim = 63
    check(moe, r"parallelism.tp=2 with ep=1 splits the experts' hidden dim: model.moe.hidden_dim=63 must be divisible by 2", 2)
    moe.job.parallelism.sequence_parallel = False
    check(moe, r"MoE layers with parallelism.tp=2 need parallelism.sequence_parallel=True", 2)
    odd = models.deepseek_v3_debugmodel()  # 8 experts
    odd.job.parallelism.dp_shard, odd.job.parallelism.ep = 3, 3
    odd.job.training.tokens_per_microbatch_per_dp_rank = 128
    check(odd, r"parallelism.ep=3 must divide model.moe.num_experts=8", 3)


@pytest.mark.slow
def test_a_235b_scale_layout_runs_a_step_under_the_fake_process_group(tmp_path, monkeypatch, capsys):
    # World 256 in one process: FSDP64 x TP4 dense, EP64 (one expert per rank, efsdp 4).
    from titan_lightning import cli
    from titan_lightning.trainer import RUN_DIR_ENV

    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    argv = ["fit", "--recipe", "recipes.qwen3:moe_235b_a22b_layout", "--trainer.strategy", "FakePGStrategy",
            "--trainer.strategy.world_size", "256", "--trainer.max_steps", "1", "--trainer.accelerator", "cpu",
            "--trainer.enable_checkpointing", "false", "--trainer.limit_val_batches", "0",
            "--trainer.num_sanity_val_steps", "0"]
    assert cli.main(argv) == 0
    assert "[fake_pg] world_size=256 rank=0 FSDP=64, TP=4, EP=64" in capsys.readouterr().out


def test_experts_built_at_setup_meet_the_rules_validate_job_gives_model_moe():
    """One rule (config/validation.py validate_expert_split), applied to the built experts when
    parallel/expert.py shards them: a model the job's model.moe does not describe is held to it too."""
    from types import SimpleNamespace

    from titan_lightning.config import ConfigError
    from titan_lightning.models.common.moe import MoE, MoEArgs
    from titan_lightning.parallel.expert import apply_expert_parallel, apply_expert_tensor_parallel

    with torch.device("meta"):
        moe = MoE(16, MoEArgs(num_experts=8, hidden_dim=7))
    mesh = lambda size: SimpleNamespace(size=lambda: size, get_group=lambda: None)  # noqa: E731 (refused before any use)
    with pytest.raises(ConfigError, match=r"^parallelism.ep=3 must divide GroupedExperts.num_experts=8$"):
        apply_expert_parallel(moe, mesh(3))
    with pytest.raises(ConfigError, match=r"^parallelism.tp=2 with ep=1 splits the experts' hidden dim: "
                                          r"GroupedExperts.hidden_dim=7 must be divisible by 2$"):
        apply_expert_tensor_parallel(moe, mesh(2))
