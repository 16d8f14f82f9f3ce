"""Float8 training through torchao (``quantize.float8``, parallel/float8.py): which linears
convert, the rules a run must pass, and training in torchao's emulation (float8 casts around
high-precision matmuls, what a CPU runs) against bf16: on one process, FSDP over 2 gloo ranks,
and FSDP's float8 all-gather under the fake process group (gloo has no float8 all-gather).

Under tensor parallelism (tensorwise) the float8 linears take torchao's float8 TP styles: TP over
2 gloo ranks without sequence parallelism against one process, and FSDP x TP with sequence
parallelism under the fake process group (its block inputs are all-gathered in float8).

Tolerances: one layer within torchao's own test bounds (test/float8/test_base.py: output SQNR
>= 18 dB, weight gradient >= 17 dB); a training curve within 0.5% of bf16's at every step
(the issue's bar for 200 steps on a GPU is 1%; here 12 steps stay under 0.05%).
"""

import copy
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import float8_cases  # (also what the ranks import, through PYTHONPATH)
from recipes import qwen3
from recipes.tests import features
from titan_lightning.config import ConfigError, Float8Config, JobConfig, validate_job
from titan_lightning.config.validation import validate_float8_device
from titan_lightning.parallel.fake import init_fake_process_group
from titan_lightning.parallel.float8 import convert_to_float8, float8_filter
from titan_lightning.recipe import on_layout
from titan_lightning.strategies import FakePGStrategy
from titan_lightning.testing.launch import launch, pythonpath_env
from titan_lightning.testing.record import RecordSteps
from titan_lightning.trainer import RUN_DIR_ENV, build_trainer

pytest.importorskip("torchao", reason='quantize.float8 needs torchao: pip install -e ".[float8]"')

HERE = Path(__file__).parent
BLOCK_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


@pytest.fixture(autouse=True)
def run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    yield
    if dist.is_initialized():  # a failed fake-PG run may leave its group behind
        dist.destroy_process_group()


def emulated(**fields) -> Float8Config:
    return Float8Config(enable=True, emulate=True, **fields)


def meta_model(run) -> nn.Module:
    with torch.device("meta"):
        return run.module.build_model()


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    return (20 * torch.log10(reference.norm() / (reference - other).norm())).item()


# -- one layer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_float8_linear_stays_within_torchaos_sqnr_of_the_high_precision_one(recipe):
    torch.manual_seed(0)
    reference = nn.Linear(256, 512, bias=False)
    model = nn.Sequential(copy.deepcopy(reference))
    assert convert_to_float8(model, emulated(recipe=recipe, filter_fqns=[])) == ["0"]
    assert type(model[0]).__name__ == "Float8Linear" and torch.equal(model[0].weight, reference.weight)
    x, grad = torch.randn(64, 256), torch.randn(64, 512)
    y_ref, y = reference(x), model(x)
    y_ref.backward(grad)
    y.backward(grad)
    assert not torch.equal(y, y_ref)  # the operands went through float8
    assert sqnr_db(y_ref, y) >= 18.0
    assert sqnr_db(reference.weight.grad, model[0].weight.grad) >= 17.0


# -- which linears convert ---------------------------------------------------------------------


def test_every_block_linear_converts_and_the_head_stays_high_precision():
    model = meta_model(features.llama3_debugmodel())
    before = linear_names(model)
    converted = convert_to_float8(model, emulated())
    assert converted == [name for name in before if name != "output"]
    assert len(converted) == 6 * len(BLOCK_LINEARS)
    assert all(float8_cases.float8(model.get_submodule(name)) for name in converted)
    assert not float8_cases.float8(model.output)


def test_a_subclass_of_linear_keeps_its_own_forward():
    """The decoder's Head (an nn.Linear whose forward also takes labels: the chunked loss) stays
    itself even when no filter names it."""
    model = meta_model(features.llama3_debugmodel())
    convert_to_float8(model, emulated(filter_fqns=[]))
    assert isinstance(model.output, nn.Linear) and not float8_cases.float8(model.output)


def test_the_filter_matches_whole_name_parts_and_skips_small_and_odd_dimensions():
    f = float8_filter(emulated(filter_fqns=["output", "layers.1"], min_dim=64))
    linear = nn.Linear(64, 128)
    assert f(linear, "layers.0.attention.output_proj")  # "output" is a whole part, not a prefix
    assert not f(linear, "output") and not f(linear, "model.output")
    assert not f(linear, "layers.1.feed_forward.w1") and f(linear, "layers.10.feed_forward.w1")
    assert not f(nn.Linear(32, 128), "w")  # 32 < min_dim
    assert not f(nn.Linear(64 + 8, 128), "w") and not f(nn.Linear(64, 128 + 8), "w")  # not divisible by 16
    assert not f(nn.Embedding(64, 64), "tok_embeddings")


def test_moe_routed_experts_and_router_gates_stay_high_precision():
    model = meta_model(qwen3.debugmodel_moe())
    experts = {name: type(m) for name, m in model.named_modules() if getattr(m, "routed_experts", False)}
    converted = convert_to_float8(model, emulated())
    assert experts and {name: type(model.get_submodule(name)) for name in experts} == experts
    assert not any(".experts" in name or "router" in name for name in converted)
    assert {name.rsplit(".", 1)[-1] for name in converted} == {"wq", "wk", "wv", "wo"}
    assert type(model.layers["0"].moe.router.gate) is nn.Linear
    ungated = meta_model(qwen3.debugmodel_moe())  # the default filter is what keeps the gates
    assert "layers.0.moe.router.gate" in convert_to_float8(ungated, emulated(filter_fqns=["output"]))


# -- the rules (the CLI's one-line errors: test_bad_input.py) -----------------------------------


def float8_job(**fields) -> JobConfig:
    job = JobConfig()
    job.quantize.float8 = Float8Config(enable=True, **fields)
    return job


def one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises((ConfigError, ValueError)) as err:
        call(*args, **kwargs)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_torchao_missing_names_the_extra(monkeypatch):
    import titan_lightning.config.quantize as quantize

    monkeypatch.setattr(quantize, "find_spec", lambda name: None)
    assert Float8Config(enable=False).enable is False  # off: torchao is not needed
    message = one_line_error(Float8Config, enable=True)
    assert "quantize.float8.enable=True needs torchao" in message and 'pip install -e ".[float8]"' in message


def test_single_field_rules_name_the_field_the_value_and_what_is_valid():
    assert "quantize.float8.recipe='mxfp8' is not one of tensorwise, rowwise" in one_line_error(
        Float8Config, recipe="mxfp8")
    assert "needs recipe='tensorwise'" in one_line_error(
        Float8Config, recipe="rowwise", enable_fsdp_float8_all_gather=True)
    assert "set quantize.float8.enable_fsdp_float8_all_gather=True too" in one_line_error(
        Float8Config, precompute_float8_dynamic_scale_for_fsdp=True)
    assert "quantize.float8.min_dim=-1 must be an integer >= 0" in one_line_error(Float8Config, min_dim=-1)


def test_float8_tp_with_sequence_parallelism_is_refused_on_gloo_only():
    """torchao's float8 TP styles (tensorwise) all-gather the sequence-parallel block inputs in float8."""
    job = float8_job(emulate=True)
    job.parallelism.tp, job.parallelism.dp_shard = 2, 1
    validate_job(job, world_size=2)  # the layout itself is fine
    assert ("quantize.float8.recipe='tensorwise' with parallelism.tp=2 and parallelism.sequence_parallel=True cannot "
            "run on CPU") in one_line_error(validate_float8_device, job, "cpu")
    validate_float8_device(job, "cpu", fake_pg=True)  # the fake group moves no data
    job.parallelism.sequence_parallel = False
    validate_float8_device(job, "cpu")  # no float8 collective: the rowwise layers reduce in high precision
    rowwise = float8_job(emulate=True, recipe="rowwise")
    rowwise.parallelism.tp = 2
    validate_float8_device(rowwise, "cpu")  # torch's styles around the float8 linears


def test_a_gpu_needs_sm89_and_compile_and_elsewhere_only_emulation_runs():
    job = float8_job()
    assert "compute capability 8.9 or newer" in one_line_error(validate_float8_device, job, "cuda", (8, 0))
    assert "needs compile.enable=True" in one_line_error(validate_float8_device, job, "cuda", (9, 0))
    job.compile.enable = True
    validate_float8_device(job, "cuda", (9, 0))
    validate_float8_device(job, "cuda", (8, 9))
    assert "on 'cpu' needs quantize.float8.emulate=True" in one_line_error(validate_float8_device, job, "cpu")
    emulating = float8_job(emulate=True)
    for device, capability in (("cuda", (8, 0)), ("cpu", None)):
        validate_float8_device(emulating, device, capability)  # no float8 kernels, no compile needed
    gathering = float8_job(emulate=True, enable_fsdp_float8_all_gather=True)
    assert "gloo has no float8 all-gather" in one_line_error(validate_float8_device, gathering, "cpu")
    validate_float8_device(gathering, "cpu", fake_pg=True)  # the fake group moves no data


def test_the_estimator_runs_a_float8_job_as_high_precision_and_leaves_the_job_as_it_was():
    from titan_lightning.estimate import estimate

    plain = estimate(features.llama3_small(), world_size=2)
    run = features.llama3_small()
    run.job.quantize.float8 = Float8Config(enable=True)  # as a GPU recipe holds it: no emulation
    assert estimate(run, world_size=2) == plain
    assert run.job.quantize.float8.enable


# -- training ----------------------------------------------------------------------------------


def fit(run, steps: int, strategy=None) -> RecordSteps:
    """Train ``run`` in this process, in a run folder of its own: module fixtures call this before
    the autouse fixture sets one, and a run exports its folder for its ranks, which would stay in
    this process's environment for every later test (a CLI test then writes elsewhere)."""
    record = RecordSteps()
    callbacks = [*run.trainer.get("callbacks", []), record]
    run.trainer.update(max_steps=steps, accelerator="cpu", devices=1, callbacks=callbacks)
    if strategy is not None:
        run.trainer["strategy"] = strategy
    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as patch:
        patch.setenv(RUN_DIR_ENV, str(Path(folder) / "run"))
        build_trainer(run).fit(run.module, datamodule=run.datamodule)
    return record


PARITY_STEPS, PARITY_LR = 12, 3e-3  # a learning rate at which 12 steps make a curve (8.0 -> 7.3)


def bf16_small(float8: str = ""):
    """The small Llama 3 with bf16 compute (fp32 weights), optionally float8 linears on top."""
    run = float8_cases.llama3_small_float8(float8) if float8 else features.llama3_small()
    run.job.training.mixed_precision_param = "bfloat16"
    run.job.optimizer.lr = PARITY_LR
    return run


@pytest.fixture(scope="module")
def bf16_losses():
    return fit(bf16_small(), PARITY_STEPS).losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_training_follows_the_bf16_loss_curve(recipe, bf16_losses):
    losses = fit(bf16_small(recipe), PARITY_STEPS).losses  # (ExpectFloat8: the linears are float8)
    assert bf16_losses[-1] < bf16_losses[0] - 0.5  # a curve, not noise around the initial loss
    assert losses == pytest.approx(bf16_losses, rel=5e-3)
    assert losses != bf16_losses  # float8 changed the numbers


@pytest.fixture(scope="module")
def one_process_float8():
    """The small Llama 3, float8, 5 steps on one process (fp32 weights and compute)."""
    return fit(float8_cases.llama3_small_float8(), 5)


def test_float8_under_selective_checkpointing_and_compile_trains_as_eager(one_process_float8):
    """The GPU's composition (float8, then per-op AC, then compiled blocks), traced without inductor."""
    run = float8_cases.llama3_small_float8()
    run.job.compile.enable, run.job.compile.backend = True, "aot_eager"
    run.job.activation_checkpoint.mode = "selective"
    record = fit(run, 5)
    assert all(getattr(block, "compiled", None) == "aot_eager" for block in run.module.model.layers.values())
    assert record.losses == one_process_float8.losses
    assert record.grad_norms == one_process_float8.grad_norms


def _assert_2_gloo_ranks_train_as(one_process, recipe: str, tmp_path, *, grad_norm_rel: float) -> None:
    """``float8_cases:<recipe>`` fit on 2 gloo ranks: on each rank, the losses within 1e-4 of the
    one-process run's, the grad norms within ``grad_norm_rel``."""
    argv = ["fit", "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--recipe", f"float8_cases:{recipe}"]
    for rank in launch(argv, 2, out_dir=tmp_path, timeout=300, env=pythonpath_env(HERE)).ranks:
        assert rank["losses"] == pytest.approx(one_process.losses, rel=1e-4)
        assert rank["grad_norms"] == pytest.approx(one_process.grad_norms, rel=grad_norm_rel)


@pytest.mark.multi_process
def test_fsdp_over_2_gloo_ranks_trains_float8_as_one_process(tmp_path, one_process_float8):
    # Not bitwise: each rank scales its own half of the batch's activations (tensorwise amax).
    _assert_2_gloo_ranks_train_as(one_process_float8, "llama3_fsdp2_float8", tmp_path, grad_norm_rel=1e-3)


def fake_fsdp2(all_gather: bool):
    run = float8_cases.llama3_small_float8()
    run.job.parallelism.dp_shard = 2
    f8 = run.job.quantize.float8
    f8.enable_fsdp_float8_all_gather = f8.precompute_float8_dynamic_scale_for_fsdp = all_gather
    return run, fit(run, 3, strategy=FakePGStrategy(world_size=2))


def test_fsdp_float8_all_gather_moves_float8_and_the_scales_follow_each_optimizer_step():
    _, high_precision = fake_fsdp2(all_gather=False)
    run, gathered = fake_fsdp2(all_gather=True)
    # Casting each shard with the weight's scale, then gathering, is casting the gathered weight.
    assert gathered.losses == high_precision.losses
    e4m3_max = torch.finfo(torch.float8_e4m3fn).max
    for name in ("layers.0.attention.wq", "layers.1.feed_forward.w2"):
        local = run.module.model.get_submodule(name).weight._local_tensor  # (to_local() makes a view without it)
        assert type(local).__name__ == "WeightWithDynamicFloat8CastTensor"
        # Precomputed by the strategy after the last optimizer step, from the weights it left.
        # (The fake group's all-reduce keeps this rank's amax.)
        expected = (e4m3_max / local._tensor.abs().max().double()).float()
        assert torch.equal(local._precomputed_scale, expected)


# -- tensor parallelism --------------------------------------------------------------------------


def tp_styles(run, monkeypatch) -> dict[str, str]:
    """The TP style class ``apply_tp`` gives each module of ``run``'s float8 model (TP 2, sequence
    parallel), by module name, under the fake process group."""
    from torch.distributed.device_mesh import init_device_mesh

    import titan_lightning.parallel.tensor as tensor

    applied, parallelize_module = {}, tensor.parallelize_module

    def record(module, mesh, style, **kwargs):
        applied[module] = type(style).__name__
        return parallelize_module(module, mesh, style, **kwargs)

    monkeypatch.setattr(tensor, "parallelize_module", record)
    model, f8 = meta_model(run), run.job.quantize.float8
    convert_to_float8(model, f8)
    init_fake_process_group(rank=0, world_size=2)
    tensor.apply_tp(model, init_device_mesh("cpu", (2,)), model.tp_plan(model.args), sequence_parallel=True,
                    loss_parallel=True, float8=f8.float8_tensor_parallel)
    return {name: applied[module] for name, module in model.named_modules() if module in applied}


def test_tp_gives_torchaos_float8_styles_to_the_float8_linears_and_the_blocks_that_feed_only_them(monkeypatch):
    run = float8_cases.llama3_small_float8()
    run.job.quantize.float8.filter_fqns = ["output", "layers.0.attention.wq"]
    styles = tp_styles(run, monkeypatch)
    for block in ("layers.1.attention", "layers.0.feed_forward", "layers.1.feed_forward"):
        assert styles[block] == "PrepareFloat8ModuleInput"  # one float8 all-gather for wq, wk, wv (w1, w3)
    for name in ("wk", "wv", "w1", "w3"):
        assert {styles[n] for n in styles if n.endswith(f".{name}")} == {"Float8ColwiseParallel"}
    for name in ("wo", "w2"):
        assert {styles[n] for n in styles if n.endswith(f".{name}")} == {"Float8RowwiseParallel"}
    # A high-precision linear keeps torch's style, and so does the block that also feeds it.
    assert styles["layers.0.attention.wq"] == "ColwiseParallel"
    assert styles["layers.1.attention.wq"] == "Float8ColwiseParallel"
    assert styles["layers.0.attention"] == "PrepareModuleInput"
    assert (styles["output"], styles["tok_embeddings"], styles["norm"]) == ("OutputParallel", "RowwiseParallel",
                                                                          "SequenceParallel")


def test_the_rowwise_recipe_keeps_torchs_tp_styles(monkeypatch):
    styles = tp_styles(float8_cases.llama3_small_float8("rowwise"), monkeypatch)
    assert (styles["layers.0.attention.wq"], styles["layers.0.feed_forward"]) == ("ColwiseParallel",
                                                                                "PrepareModuleInput")
    assert not [name for name, style in styles.items() if "Float8" in style]


@pytest.mark.multi_process
def test_tp_over_2_gloo_ranks_trains_float8_as_one_process(tmp_path, one_process_float8):
    # Not bitwise: the same scales (a sharded operand's amax is all-reduced), but the rowwise
    # layers sum two partial matmuls; the float8 roundings then drift apart (seen: 3e-6, 1e-5).
    _assert_2_gloo_ranks_train_as(one_process_float8, "llama3_tp2_float8", tmp_path, grad_norm_rel=1e-4)


@pytest.mark.parametrize("all_gather", [False, True], ids=["", "fsdp_float8_all_gather"])
def test_fsdp2_tp2_with_sequence_parallelism_trains_float8_under_the_fake_process_group(all_gather):
    run = on_layout(float8_cases.llama3_small_float8(), dp_shard=2, tp=2)
    f8 = run.job.quantize.float8
    f8.enable_fsdp_float8_all_gather = f8.precompute_float8_dynamic_scale_for_fsdp = all_gather
    record = fit(run, 2, strategy=FakePGStrategy(world_size=4))  # (ExpectFloat8: the linears are float8)
    assert len(record.losses) == 2 and all(torch.isfinite(torch.tensor(record.losses + record.grad_norms)))
    assert run.module.model.layers["0"].attention.wq.weight.device_mesh.mesh_dim_names == ("dp_shard", "tp")
