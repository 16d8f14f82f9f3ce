"""Pipeline parallelism below the Trainer: split points, stage placement, stage views, validation.

Multi-process behaviour (every schedule and composition against one process) is checked by
the real-PG integration entries llama3_pp2* (features suite) and *_pp2_* (models suite), and
a user's own module on two stages by test_strategies.py.
"""

import warnings

import pytest
import torch

from recipes.tests import features
from titan_lightning.config import ConfigError, ParallelismConfig, validate_job
from titan_lightning.models.llama3.model import Llama3Args, Transformer
from titan_lightning.parallel.pipeline import (
    PipelinePlan,
    check_stage_modules,
    describe_split,
    split_layers,
    split_model,
    split_pipeline,
    stage_ids,
    stage_module_names,
    stage_rank,
)
from titan_lightning.strategies.logs import average_records
from titan_lightning.strategies.pipeline import _rows

PLAN = PipelinePlan()


@pytest.mark.parametrize(
    "n_layers, stages, weights, expected",
    [
        (6, 2, (1, 1), [[0, 1, 2], [3, 4, 5]]),
        # 7 units: the first stage takes the extra one, its embedding counts as a layer.
        (5, 2, (1, 1), [[0, 1, 2], [3, 4]]),
        (7, 4, (1, 1), [[0, 1], [2, 3], [4, 5], [6]]),
        (6, 4, (0, 0), [[0, 1], [2, 3], [4], [5]]),
        # A heavy head: the last stage gets fewer blocks.
        (8, 2, (0, 4), [[0, 1, 2, 3, 4, 5], [6, 7]]),
        # A stage whose share is all weight keeps no block; its deficit moves to the next.
        (2, 2, (5, 0), [[], [0, 1]]),
        (3, 3, (1, 1), [[0], [1, 2], []]),
    ],
)
def test_split_layers_balances_layers_with_weighted_ends(n_layers, stages, weights, expected):
    got = split_layers(n_layers, stages, first_weight=weights[0], last_weight=weights[1])
    assert got == expected
    assert [i for stage in got for i in stage] == list(range(n_layers))


def test_more_stages_than_layers_are_refused_by_the_one_rule():
    """config.validation's rule: before launch for a job's model (test_bad_pipeline_settings_...),
    when the model is split for a module without a job."""
    module = torch.nn.Module()
    module.model = _model(n_layers=3)
    p = ParallelismConfig(pp=2, pp_schedule="Interleaved1F1B", pp_microbatches=2)
    with pytest.raises(ConfigError, match=r"pp=2 x 2 stages per rank = 4 stages is more than len\(Transformer.layers\)=3"):
        split_pipeline(module, PLAN, p, pp_rank=0)
    with pytest.raises(ValueError, match=r"num_stages=4 must be in \[1, n_layers=3\]"):
        split_layers(3, 4)  # (the function's own precondition)


def test_stage_module_names_put_embedding_first_and_head_last():
    names = stage_module_names(PLAN, ["0", "1", "2"], [[0], [1, 2]])
    assert names == [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "norm", "output"]]


@pytest.mark.parametrize("pp, per_rank, placement, expected", [
    (2, 1, "loop", {0: [0], 1: [1]}),
    (2, 2, "loop", {0: [0, 2], 1: [1, 3]}),
    (4, 2, "loop", {0: [0, 4], 3: [3, 7]}),
    (2, 2, "v", {0: [0, 3], 1: [1, 2]}),
    (4, 2, "v", {0: [0, 7], 3: [3, 4]}),
])
def test_stage_placement_and_its_inverse(pp, per_rank, placement, expected):
    for rank, stages in expected.items():
        assert stage_ids(rank, pp, per_rank, placement) == stages
    for rank in range(pp):
        for stage in stage_ids(rank, pp, per_rank, placement):
            assert stage_rank(stage, pp, placement) == rank


@pytest.mark.parametrize("stages, message", [
    ([["tok_embeddings", "layers.0"], ["layers.2", "norm", "output"]], r"missing \['layers.1'\]"),
    ([["tok_embeddings", "layers.1"], ["layers.0", "layers.2", "norm", "output"]], r"the order differs"),
    ([["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm"], ["output"]], r"\['norm'\]: .* to the last"),
    ([["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "lm_head", "norm", "output"]], r"unknown \['lm_head'\]"),
])
def test_explicit_stage_modules_must_cover_the_model_in_order(stages, message):
    with pytest.raises(ConfigError, match=message):
        check_stage_modules(PLAN, ["0", "1", "2"], stages, 2)


def _model(n_layers: int = 5) -> Transformer:
    args = Llama3Args(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32)
    model = Transformer(args)
    model.init_weights(seed=3)
    return model


def test_stage_views_chain_to_the_whole_model_and_keep_the_unsplit_names():
    full = _model()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = full(tokens)
    names = stage_module_names(PLAN, list(full.layers.keys()), split_layers(5, 3))
    part = _model()
    views = split_model(part, PLAN, names, [0, 1, 2])
    h = tokens
    for view in views:
        h = view(h)
    torch.testing.assert_close(h, expected, rtol=0, atol=0)
    # Each view holds its stage's parameters under the whole model's names; together, all of them.
    keys = [set(view.state_dict()) - {"rope_cache"} for view in views]
    assert set.union(*keys) == set(full.state_dict())
    assert sum(len(k) for k in keys) == len(full.state_dict())
    assert "layers.4.attention.wq.weight" in keys[2] and "tok_embeddings.weight" in keys[0]
    # Views share the model's modules: a change to one is a change to the other.
    assert views[1].layers["2"] is part.layers["2"]


def test_split_model_trims_the_rank_model_to_its_own_stages():
    model = _model()
    names = stage_module_names(PLAN, list(model.layers.keys()), split_layers(5, 4))  # [[0,1],[2],[3],[4]]... by weight
    views = split_model(model, PLAN, names, [1, 3])
    assert model.tok_embeddings is None
    assert model.output is not None and model.norm is not None
    kept = sorted(model.layers.keys())
    assert kept == sorted(k.split(".")[1] for s in (1, 3) for k in names[s] if k.startswith("layers."))
    assert views[0].output is None and views[1].output is model.output
    # Materializing the model reaches the views' buffers (one shared dict).
    model.rope_cache = torch.zeros_like(model.rope_cache)
    assert views[0].rope_cache is model.rope_cache


def test_microbatch_rows_and_averaged_logs():
    batch = {"input_ids": torch.arange(8).view(4, 2), "labels": torch.arange(8).view(4, 2) + 1, "step": 3}
    rows = _rows(batch, torch.tensor([2, 3]), 4)
    assert rows["input_ids"].tolist() == [[4, 5], [6, 7]] and rows["step"] == 3
    records = [("train/loss", torch.tensor(2.0), {"prog_bar": True}), ("train/loss", torch.tensor(4.0), {"prog_bar": True}),
               ("tag", "x", {})]
    averaged = dict((name, (value, kwargs)) for name, value, kwargs in average_records(records))
    assert averaged["train/loss"][0].item() == 3.0 and averaged["train/loss"][1] == {"prog_bar": True}
    assert averaged["tag"][0] == "x"


def test_describe_split_names_the_layout():
    config = ParallelismConfig(pp=2, pp_schedule="Interleaved1F1B", pp_microbatches=4)
    line = describe_split(stage_module_names(PLAN, [str(i) for i in range(6)], split_layers(6, 4)), config, "loop")
    assert line.startswith("Interleaved1F1B, 4 stages (2 per rank, loop), 4 microbatches")
    assert "0: tok_embeddings + layer 0" in line and "3: layer 5 + norm + output" in line


def _job(**parallelism):
    run = features.llama3_debugmodel()  # 6 layers, 4 sequences per rank
    for name, value in parallelism.items():
        setattr(run.job.parallelism, name, value)
    return run.job


@pytest.mark.parametrize("parallelism, world, message", [
    (dict(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=1, pp_microbatches=2), 2,
     r"pp_schedule='Interleaved1F1B' is a looped schedule .*pp_stages_per_rank=1"),
    (dict(pp=2, pp_schedule="1F1B", pp_stages_per_rank=2, pp_microbatches=2), 2,
     r"pp_schedule='1F1B' runs one stage per rank, but parallelism.pp_stages_per_rank=2"),
    (dict(pp=2, pp_schedule="ZBVZeroBubble", pp_stages_per_rank=3, pp_microbatches=4), 2,
     r"places 2 stages per rank in a V; parallelism.pp_stages_per_rank=3 must be 2"),
    (dict(pp=4, pp_schedule="Interleaved1F1B", pp_microbatches=4), 4,
     r"pp=4 x 2 stages per rank = 8 stages is more than model.n_layers=6"),
    (dict(pp=2, pp_microbatches=3), 2, r"pp_microbatches=3 must divide the local batch of 4 sequences"),
    (dict(pp=4, pp_microbatches=2), 4, r"pp_microbatches=2 must be >= parallelism.pp=4 for the 1F1B schedule"),
    (dict(pp=2, pp_schedule="LoopedBFS", pp_microbatches=1), 2, r"must be >= parallelism.pp=2 for the looped"),
    (dict(pp=2, pp_stage_modules=[["tok_embeddings"]], pp_microbatches=2), 2,
     r"pp_stage_modules lists 1 stages, but pp=2 x 1 stages per rank = 2"),
    (dict(pp=2, pp_schedule_csv="/no/such/schedule.csv", pp_microbatches=2), 2,
     r"pp_schedule_csv='/no/such/schedule.csv' is not a file"),
])
def test_bad_pipeline_settings_fail_validation_naming_the_values(parallelism, world, message):
    with pytest.raises(ConfigError, match=message):
        validate_job(_job(dp_shard=1, **parallelism), world_size=world)


def test_unknown_schedule_and_weights_fail_in_the_section():
    with pytest.raises(ValueError, match=r"pp_schedule='2F2B' is not one of GPipe, 1F1B"):
        ParallelismConfig(pp_schedule="2F2B")
    with pytest.raises(ValueError, match=r"pp_last_stage_weight=-1 must be an integer >= 0"):
        ParallelismConfig(pp_last_stage_weight=-1)
    with pytest.raises(ValueError, match=r"pp_stages_per_rank=0 must be an integer >= 1"):
        ParallelismConfig(pp_stages_per_rank=0)


def test_fewer_microbatches_than_stages_warns():
    with pytest.warns(UserWarning, match=r"pp_microbatches=2 is fewer than the 4 pipeline stages"):
        validate_job(_job(dp_shard=1, pp=2, pp_schedule="Interleaved1F1B", pp_microbatches=2), world_size=2)
    with pytest.warns(UserWarning, match=r"pp_microbatches=1 is fewer than the 2 pipeline stages"):
        validate_job(_job(dp_shard=1, pp=2, pp_schedule="GPipe", pp_microbatches=1), world_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_job(_job(dp_shard=1, pp=2, pp_microbatches=2), world_size=2)


def test_fake_pg_refuses_pipeline_parallelism_before_any_work():
    from titan_lightning.strategies import FakePGStrategy

    with pytest.raises(ConfigError, match=r"parallelism.pp=2: pipeline parallelism cannot run under the fake"):
        FakePGStrategy(world_size=4, parallelism=ParallelismConfig(pp=2, dp_shard=2, pp_microbatches=2))._configure_launcher()


def test_pipeline_parallel_strategy_takes_every_rank_and_checks_before_spawn():
    import lightning as L

    from titan_lightning import PipelineParallelStrategy

    def trainer(strategy, devices):
        return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    config = trainer(PipelineParallelStrategy(), 4).strategy.default_parallelism()
    assert (config.pp, config.dp_shard, config.pp_microbatches, config.pp_schedule) == (4, 1, 4, "1F1B")
    config = trainer("pipeline_parallel", 2).strategy.default_parallelism()  # registry name
    assert (config.pp, config.pp_microbatches) == (2, 2)
    looped = trainer(PipelineParallelStrategy(pp_schedule="Interleaved1F1B", pp_microbatches=8), 2).strategy
    assert looped.default_parallelism().stages_per_rank == 2
    with pytest.raises(ConfigError, match=r"pp_microbatches=1 must be >= parallelism.pp=4 for the 1F1B schedule"):
        trainer(PipelineParallelStrategy(pp_microbatches=1), 4)
    with pytest.raises(ConfigError, match=r"pp_schedule='LoopedBFS' is a looped schedule"):
        trainer(PipelineParallelStrategy(pp_schedule="LoopedBFS", pp_stages_per_rank=1, pp_microbatches=4), 4)
