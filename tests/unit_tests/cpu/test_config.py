"""Every configuration rule, with the message it gives."""

import pytest

from titan_lightning.config import (
    ConfigError,
    DataConfig,
    JobConfig,
    LRScheduleConfig,
    ModelArgs,
    OptimizerConfig,
    ParallelismConfig,
    TrainingConfig,
    validate_job,
)
from titan_lightning.config.validation import gradient_accumulation_steps


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: TrainingConfig(seq_len=0), r"training.seq_len=0 must be a positive integer"),
        (
            lambda: TrainingConfig(seq_len=64, tokens_per_microbatch_per_dp_rank=0),
            r"training.tokens_per_microbatch_per_dp_rank=0 must be a positive integer",
        ),
        (
            lambda: TrainingConfig(seq_len=64, tokens_per_microbatch_per_dp_rank=100),
            r"tokens_per_microbatch_per_dp_rank=100 must be a multiple of training.seq_len=64",
        ),
        (
            lambda: TrainingConfig(seq_len=64, tokens_per_microbatch_per_dp_rank=128, tokens_per_step=192),
            r"training.tokens_per_step=192 must be a multiple of training.tokens_per_microbatch_per_dp_rank=128",
        ),
        (lambda: TrainingConfig(max_grad_norm=0.0), r"training.max_grad_norm=0.0 must be > 0, or None"),
        (
            lambda: TrainingConfig(dtype="bfloat16", mixed_precision_param="float32"),
            r"mixed_precision_param='float32' cannot compute in fp32",
        ),
        (lambda: OptimizerConfig(lr=0.0), r"optimizer.lr=0.0 must be > 0"),
        (lambda: OptimizerConfig(beta2=1.0), r"optimizer.beta2=1.0 must be in \[0, 1\)"),
        (lambda: OptimizerConfig(eps=0.0), r"optimizer.eps=0.0 must be > 0"),
        (lambda: OptimizerConfig(weight_decay=-1.0), r"optimizer.weight_decay=-1.0 must be >= 0"),
        (lambda: LRScheduleConfig(warmup_steps=-1), r"lr_schedule.warmup_steps=-1 must be an integer >= 0"),
        (lambda: LRScheduleConfig(decay_ratio=1.5), r"lr_schedule.decay_ratio=1.5 must be in \[0, 1\]"),
        (lambda: LRScheduleConfig(min_lr_factor=2.0), r"lr_schedule.min_lr_factor=2.0 must be in \[0, 1\]"),
        (lambda: DataConfig(val_fraction=1.0), r"data.val_fraction=1.0 must be in \[0, 1\)"),
        (lambda: DataConfig(num_workers=-1), r"data.num_workers=-1 must be >= 0"),
        (lambda: ParallelismConfig(tp=0), r"parallelism.tp=0 must be an integer >= 1"),
        (lambda: ParallelismConfig(dp_replicate=-1), r"parallelism.dp_replicate=-1 must be an integer >= 1"),
        (lambda: ParallelismConfig(dp_shard=-2), r"parallelism.dp_shard=-2 must be -1 \(the rest\) or an integer >= 1"),
        (lambda: ParallelismConfig(dp_shard=0), r"parallelism.dp_shard=0 must be -1"),
        (lambda: ParallelismConfig(pp_microbatches=0), r"parallelism.pp_microbatches=0 must be an integer >= 1"),
        (lambda: ParallelismConfig(pp_schedule="2F2B"), r"parallelism.pp_schedule='2F2B' is not one of GPipe, 1F1B"),
        (
            lambda: ParallelismConfig(cp_load_balancer="roundrobin"),
            r"parallelism.cp_load_balancer='roundrobin' is not one of headtail, ptrr or None",
        ),
        (lambda: ModelArgs(n_heads=12, n_kv_heads=8), r"model.n_heads=12 must be a multiple of model.n_kv_heads=8"),
        (lambda: ModelArgs(vocab_size=0), r"model.vocab_size=0 must be a positive integer"),
    ],
)
def test_single_field_rule_names_field_and_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_defaults_are_valid_for_one_process():
    validate_job(JobConfig(), world_size=1, max_steps=1000)


def _job(**parallelism) -> JobConfig:
    return JobConfig(
        training=TrainingConfig(seq_len=64, tokens_per_microbatch_per_dp_rank=128),
        parallelism=ParallelismConfig(**parallelism),
    )


@pytest.mark.parametrize(
    "parallelism, world_size, message",
    [
        (dict(dp_shard=2, tp=2), 8, r"dp_replicate\*dp_shard\*tp\*pp\*cp = 1\*2\*2\*1\*1 = 4 must equal the world size 8"),
        (dict(tp=3), 8, r"world size 8 is not divisible by dp_replicate\*tp\*pp\*cp = 1\*3\*1\*1 = 3"),
        (dict(dp_shard=2, ep=3), 2, r"parallelism.ep=3 must divide dp_shard\*cp\*tp = 2\*1\*1 = 2"),
        (
            dict(pp=2, pp_schedule="Interleaved1F1B", pp_microbatches=1),
            2,
            r"parallelism.pp_microbatches=1 must be >= parallelism.pp=2 for the looped schedule Interleaved1F1B",
        ),
        (dict(tp=32), 32, r"model.n_heads=16 must be divisible by parallelism.tp=32"),
        (dict(cp=3, dp_shard=1), 3, r"parallelism.cp=3 needs a context-parallel attention, but model.attention='sdpa'"),
    ],
)
def test_cross_section_rule_names_fields_and_values(parallelism, world_size, message):
    with pytest.raises(ConfigError, match=message):
        validate_job(_job(**parallelism), world_size=world_size)


def test_dp_shard_minus_one_takes_the_rest():
    p = ParallelismConfig(tp=2, pp=2)
    assert p.degrees(16) == {"pp": 2, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2}
    validate_job(_job(tp=2, pp=2, pp_microbatches=2), world_size=16)  # 2 sequences per rank, 2 microbatches


def test_ep_borrows_ranks_from_dp_shard_cp_tp():
    from titan_lightning.models.qwen3 import Qwen3Job, qwen3_args

    job = Qwen3Job(model=qwen3_args("debugmodel_moe"), training=_job().training,
                   parallelism=ParallelismConfig(dp_shard=2, cp=2, tp=2, ep=8))
    job.model.attention = "allgather"
    validate_job(job, world_size=8)  # ep=8 = dp_shard*cp*tp: efsdp 1


def test_tokens_per_step_derives_accumulation_and_must_fit_dp_degree():
    job = JobConfig(
        training=TrainingConfig(seq_len=64, tokens_per_microbatch_per_dp_rank=128, tokens_per_step=1024),
        parallelism=ParallelismConfig(dp_shard=-1),
    )
    assert gradient_accumulation_steps(job, world_size=1) == 8
    assert gradient_accumulation_steps(job, world_size=4) == 2
    with pytest.raises(ConfigError, match=r"tokens_per_step=1024 must be a multiple of .* = 128 \* 16 = 2048"):
        validate_job(job, world_size=16)


def test_sequence_must_fit_the_model_context():
    from titan_lightning.models.llama3 import Llama3Job, llama3_args

    job = Llama3Job(model=llama3_args("debugmodel"), training=TrainingConfig(seq_len=4096, tokens_per_microbatch_per_dp_rank=4096))
    with pytest.raises(ConfigError, match=r"training.seq_len=4096 must be <= model.max_seq_len=2048"):
        validate_job(job, world_size=1)


def test_schedule_needs_at_least_one_step():
    with pytest.raises(ConfigError, match=r"trainer.max_steps=0 must be >= 1"):
        validate_job(JobConfig(), world_size=1, max_steps=0)


def test_fields_changed_after_construction_are_checked_again():
    job = JobConfig()
    job.training.seq_len = 100  # no longer divides tokens_per_microbatch_per_dp_rank
    with pytest.raises(ValueError, match=r"tokens_per_microbatch_per_dp_rank=8192 must be a multiple of training.seq_len=100"):
        validate_job(job, world_size=1)


def test_a_job_passes_once_per_launch_and_is_checked_again_once_changed(monkeypatch):
    from titan_lightning.config import validation

    runs = []
    check = validation._check_job
    monkeypatch.setattr(validation, "_check_job", lambda job, **launch: (runs.append(launch), check(job, **launch)))
    job = _job(dp_shard=2)
    validate_job(job, world_size=2, max_steps=10)
    validate_job(job, world_size=2, max_steps=10)  # (the strategy's setup after build_trainer's check)
    assert len(runs) == 1
    validate_job(job, world_size=2, max_steps=20)  # another launch
    assert len(runs) == 2
    job.parallelism.tp = 32  # changed since it passed
    with pytest.raises(ConfigError, match=r"must equal the world size 2"):
        validate_job(job, world_size=2, max_steps=20)
    validate_job(_job(dp_shard=2), world_size=2, max_steps=10)  # an equal job, but another object
    assert len(runs) == 4


def test_compile_settings_are_validated_by_name():
    from titan_lightning.config import CompileConfig

    with pytest.raises(ValueError, match=r"compile.components has \['optimizer'\]; valid components are model, loss"):
        CompileConfig(components=["optimizer"])
    with pytest.raises(ValueError, match=r"compile.backend='' is not a torch.compile backend; valid: .*inductor"):
        CompileConfig(backend="")


@pytest.mark.parametrize("precision, expected", [
    ("bf16-mixed", ("float32", "bfloat16")), ("bf16-true", ("bfloat16", "bfloat16")), ("32-true", ("float32", "float32")),
])
def test_lightning_precision_flag_maps_onto_the_job_without_a_second_autocast(precision, expected):
    from recipes.tests import features
    from titan_lightning.trainer import build_trainer

    run = features.llama3_debugmodel()
    run.trainer["precision"] = precision
    trainer = build_trainer(run)
    t = run.job.training
    assert (t.dtype, t.mixed_precision_param) == expected
    assert trainer.precision == "32-true"  # Lightning's plugin does not autocast on top


def test_lightning_precision_flag_names_what_is_not_supported_or_contradicts():
    from recipes.tests import features
    from titan_lightning.config import ConfigError
    from titan_lightning.trainer import build_trainer

    run = features.llama3_debugmodel()
    run.trainer["precision"] = "16-mixed"
    with pytest.raises(ConfigError, match=r"trainer.precision='16-mixed' is not supported; use one of 32-true"):
        build_trainer(run)
    run = features.llama3_debugmodel_bf16()
    run.trainer["precision"] = "bf16-true"
    with pytest.raises(ConfigError, match=r"disagrees with training.dtype='float32', training.mixed_precision_param='bfloat16'"):
        build_trainer(run)


def test_profiling_traces_the_chosen_step(tmp_path, monkeypatch):
    import json

    from recipes.tests import features
    from titan_lightning.config import ProfilingConfig
    from titan_lightning.trainer import RUN_DIR_ENV, build_trainer

    with pytest.raises(ValueError, match=r"profiling.trace_steps has \[0\]; steps are integers >= 1"):
        ProfilingConfig(trace_steps=[0])
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    run = features.llama3_debugmodel()
    run.trainer["max_steps"] = 2
    run.job.profiling.trace_steps = [2]
    trainer = build_trainer(run)
    trainer.fit(run.module, datamodule=run.datamodule)
    (trace,) = (tmp_path / "profile").glob("*.json")
    assert trace.name == "trace_step2_rank0.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::mm" in e.get("name", "") for e in events)
