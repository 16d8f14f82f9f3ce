"""titan-lightning estimate: per-rank memory of a training step on fake tensors and the fake group."""

import importlib
import inspect
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from titan_lightning import cli
from titan_lightning.estimate import estimate, in_flight, materialized_nodes
from titan_lightning.models.causal_lm import cross_entropy_loss
from titan_lightning.models.llama3.model import Transformer
from titan_lightning.optim import build_optimizer
from titan_lightning.config import ConfigError, validate_job
from titan_lightning.recipe import RECIPE_PARAMETERS, build_run


@pytest.fixture(autouse=True)
def no_process_group_left():
    yield
    assert not dist.is_initialized()


def debug_run(recipe: str = "debugmodel", **training):
    """The debug model (2 of its 6 layers, to stay quick) on ``recipe``'s layout."""
    run = build_run(f"recipes.llama3:{recipe}")
    run.job.model.n_layers = 2
    for name, value in training.items():
        setattr(run.job.training, name, value)
    return run


def parameter_bytes(run, tp: int = 1) -> int:
    """The model's parameter bytes, counted on the meta device; under TP everything but the norms is halved."""
    with torch.device("meta"):
        model = Transformer(run.job.model)
    norms = sum(p.numel() for name, p in model.named_parameters() if name.endswith("norm.weight"))
    total = sum(p.numel() for p in model.parameters())
    return ((total - norms) // tp + norms) * 4  # fp32


@pytest.mark.parametrize("recipe, world_size, divisor, tp", [
    ("debugmodel", 1, 1, 1),
    ("debugmodel", 4, 4, 1),  # dp_shard=-1: FSDP over 4 ranks (every dim 0 divides by 4)
    ("tp2", 2, 1, 2),
])
def test_parameters_gradients_and_optimizer_state_are_the_local_shards(recipe, world_size, divisor, tp):
    run = debug_run(recipe)
    expected = parameter_bytes(run, tp) // divisor
    result = estimate(run, world_size)
    assert result.parameters == expected
    # Under TP (torch 2.13) the vocab-sharded embedding's gradient comes back a full-size
    # Replicate DTensor: the estimate reports it as the run holds it.
    a = run.job.model
    replicated = a.vocab_size * a.dim * 4 * (tp - 1) // tp
    assert result.gradients == expected + replicated
    assert result.optimizer_state == 2 * expected  # AdamW: exp_avg and exp_avg_sq
    assert result.peak > result.static


def test_activation_checkpointing_lowers_activations_in_order():
    activations = {}
    for mode in ("none", "selective", "full"):
        run = debug_run()
        run.job.activation_checkpoint.mode = mode
        activations[mode] = estimate(run, 1).activations
    assert activations["none"] > activations["selective"] > activations["full"]


def test_activations_grow_linearly_with_the_sequence():
    short = estimate(debug_run(seq_len=128, tokens_per_microbatch_per_dp_rank=1024), 1)
    long = estimate(debug_run(seq_len=256, tokens_per_microbatch_per_dp_rank=2048), 1)
    assert long.parameters == short.parameters
    assert 1.9 < long.activations / short.activations < 2.1


def test_trainer_precision_sets_the_dtypes_as_the_trainer_does():
    """``--trainer.precision bf16-mixed`` on ``estimate`` is the run's bf16 compute: a LoRA base is
    stored in it (as build_trainer maps the flag); the estimate ignored it and counted an fp32 base."""
    from titan_lightning.config.lora import LoRAConfig

    estimates = {}
    for precision in ("32-true", "bf16-mixed", None):
        run = debug_run(**({} if precision else {"mixed_precision_param": "bfloat16"}))
        run.job.lora = LoRAConfig(rank=4)
        if precision:
            run.trainer["precision"] = precision
        estimates[precision] = estimate(run, 1)
    assert estimates["bf16-mixed"].parameters == estimates[None].parameters  # (the job's fields set directly)
    assert estimates["bf16-mixed"].parameters < 0.6 * estimates["32-true"].parameters
    run = debug_run(mixed_precision_param="bfloat16")
    run.trainer["precision"] = "bf16-true"
    with pytest.raises(ConfigError, match="trainer.precision='bf16-true' disagrees with training.dtype='float32'"):
        estimate(run, 1)


@pytest.mark.slow  # inductor's decompositions and partitioner: ~7 s, out of the inner loop
def test_compile_saves_less_than_eager():
    eager = estimate(debug_run(mixed_precision_param="bfloat16"), 1)
    run = debug_run(mixed_precision_param="bfloat16")
    run.job.compile.enable = True
    compiled = estimate(run, 1)
    assert compiled.static == eager.static
    assert compiled.activations < 0.9 * eager.activations


@pytest.mark.slow  # three compiled estimates: ~15 s
def test_compiled_activation_checkpointing_lowers_activations_in_order():
    """Compiled and checkpointed blocks (the recompute's ``run_and_save_rng_state`` around the
    attention, a higher-order operator) estimate; each mode saves less than the one before."""
    activations = {}
    for mode in ("none", "selective", "full"):
        run = debug_run(mixed_precision_param="bfloat16")
        run.job.compile.enable = True
        run.job.activation_checkpoint.mode = mode
        activations[mode] = estimate(run, 1).activations
    assert activations["none"] > activations["selective"] > activations["full"]


def test_cross_entropy_backward_one_hot_is_fused_like_inductor_does():
    """full + scatter (the one-hot of the backward) is a pointwise select under inductor: neither
    takes a logits-sized buffer (they were 8 GiB of fp32 in the Llama 3 1B estimate at seq 8192)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import select_decomp_table

    kept = []

    def compiler(gm, example_inputs):
        kept.append({n.target for n in materialized_nodes(gm.graph) if n.op == "call_function"})
        return gm

    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition,
                           decompositions=select_decomp_table())
    torch._dynamo.reset()
    logits = torch.randn(1, 16, 50, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(cross_entropy_loss, backend=backend)(logits, torch.randint(0, 50, (1, 16))).backward()
    forward, backward = kept
    aten = torch.ops.aten
    assert aten.scatter.value not in backward and aten.full.default not in backward
    assert aten.amax.default in forward  # reductions feeding the backward are saved


def measured_peak(run) -> int:
    """Peak bytes of ``run``'s module trained for real on CPU, in the order a Trainer runs it
    (forward and loss, backward, step, the module's zero_grad: test_causal_lm pins that the
    gradients are gone before the next forward), measured by torch's MemTracker over the second step."""
    module, t = run.module, run.job.training
    with torch.device("meta"):
        module.model = module.build_model()
    module.materialize(torch.device("cpu"))
    optimizer = build_optimizer(module.model.parameters(), run.job.optimizer, torch.device("cpu"))
    tokens = torch.randint(0, run.job.model.vocab_size, (t.microbatch_size, t.seq_len))

    def step():
        loss = module.loss_fn(module.loss_input(tokens), tokens)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = MemTracker()
    tracker.track_external(module.model, optimizer)
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("mixed_precision_param", ["float32", "bfloat16"])
def test_estimate_matches_the_measured_peak_of_real_tensors(mixed_precision_param):
    """The debug model trained for real on CPU, measured by torch's MemTracker over the second step."""
    small = dict(mixed_precision_param=mixed_precision_param, seq_len=64, tokens_per_microbatch_per_dp_rank=128)
    measured = measured_peak(debug_run(**small))
    estimated = estimate(debug_run(**small), 1).peak
    assert abs(estimated - measured) <= 0.1 * measured


def test_cli_prints_the_table_and_json(capsys):
    argv = ["estimate", "--recipe", "recipes.llama3:fsdp2_tp2", "--world_size", "4", "--job.model.n_layers", "2"]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "rank 0 of 4: FSDP=2, TP=2" in table
    for row in ("parameters", "gradients", "optimizer state", "activations", "peak"):
        assert row in table
    assert cli.main(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 4 and report["unit"] == "bytes"
    assert report["peak"] == report["parameters"] + report["gradients_at_peak"] + report["optimizer_state"] + \
        report["buffers"] + report["activations"]
    assert 0 <= report["gradients_at_peak"] <= report["gradients"]


@pytest.mark.parametrize("argv, message", [
    (["--recipe", "recipes.llama3:fsdp2_tp2", "--world_size", "6"],
     "dp_replicate*dp_shard*tp*pp*cp = 1*2*2*1*1 = 4 must equal the world size 6"),
    (["--recipe", "recipes.llama3:debugmodel", "--world_size", "3", "--job.parallelism.tp", "2"],
     "world size 3 is not divisible by dp_replicate*tp*pp*cp"),
    (["--recipe", "recipes.llama3:debugmodel"], "estimate needs --world_size N"),
    (["--recipe", "recipes.llama3:debugmodel", "--world_size", "two"], "--world_size: invalid int value: 'two'"),
    (["--recipe", "recipes.llama3:pp2_tp2", "--world_size", "4"],
     "parallelism.pp=2 with tp=2, cp=1, ep=1: the estimator models pipeline stages with data parallelism"),
])
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert cli.main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert message in err


# -- mixture of experts (balanced routing) --------------------------------------------------


def moe_run(recipe: str = "debugmodel_moe", top_k: int = 2, **training):
    """The debug MoE model cut down to stay quick: 2 of its 8 layers, 8 of its 64 experts,
    microbatches of 2 x 64 tokens."""
    run = build_run(f"recipes.qwen3:{recipe}")
    run.job.model.n_layers = 2
    run.job.model.moe.num_experts, run.job.model.moe.top_k = 8, top_k
    t = run.job.training
    training = dict(seq_len=64, tokens_per_microbatch_per_dp_rank=128, **training)
    for name, value in training.items():
        setattr(t, name, value)
    return run


def moe_parameter_bytes(run) -> tuple[int, int]:
    """(dense, routed-expert) fp32 parameter bytes of the MoE model, counted on the meta device."""
    from titan_lightning.models.qwen3.model import Transformer as Qwen3

    with torch.device("meta"):
        model = Qwen3(run.job.model)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".moe.experts." in name)
    return (sum(p.numel() for p in model.parameters()) - experts) * 4, experts * 4


@pytest.mark.parametrize("recipe, world_size, dense_shards, ep", [
    ("debugmodel_moe", 1, 1, 1),
    ("moe_fsdp2_ep2", 2, 2, 2),  # dense layers FSDP over 2; experts EP over 2 (efsdp 1)
])
def test_moe_parameters_are_the_local_shards(recipe, world_size, dense_shards, ep):
    from titan_lightning.models.common.moe import GroupedExperts

    run = moe_run(recipe)
    dense, experts = moe_parameter_bytes(run)
    result = estimate(run, world_size)
    assert result.parameters == dense // dense_shards + experts // ep
    assert result.gradients == result.parameters
    assert result.optimizer_state == 2 * result.parameters
    e = run.job.model.moe.num_experts
    for module in run.module.model.modules():
        if isinstance(module, GroupedExperts):
            assert all(w.to_local().shape[0] == e // ep if ep > 1 else w.shape[0] == e
                       for w in (module.w1, module.w2, module.w3))
    assert result.peak > result.static


def test_moe_activations_grow_linearly_with_top_k():
    """Balanced routing: every expert gets tokens * top_k / num_experts pairs, so what the
    experts save grows by the same amount per extra top-k slot."""
    activations = {k: estimate(moe_run(top_k=k), 1).activations for k in (1, 2, 4)}
    assert activations[1] < activations[2] < activations[4]
    assert 1.8 < (activations[4] - activations[2]) / (activations[2] - activations[1]) < 2.2


def test_moe_estimate_matches_the_measured_peak_of_real_tensors():
    """The debug MoE model trained for real on CPU (real routing), measured by MemTracker. At
    one rank the experts' memory depends on the number of (token, expert) pairs only, not on
    how they are spread, so real routing and the estimate's balanced routing agree."""
    measured = measured_peak(moe_run())
    estimated = estimate(moe_run(), 1).peak
    assert abs(estimated - measured) <= 0.1 * measured, (estimated, measured)


def test_a_model_the_estimator_cannot_run_fails_with_one_line(monkeypatch, capsys):
    """Without the balanced-routing patch the per-expert loop reads counts fake tensors do not have."""
    from titan_lightning import estimate as estimate_module

    from titan_lightning.models.common import moe

    monkeypatch.setattr(estimate_module, "_balanced_count_tokens", moe.count_tokens)
    argv = ["estimate", "--recipe", "recipes.qwen3:debugmodel_moe", "--world_size", "1",
            "--job.model.n_layers", "1", "--job.training.seq_len", "64",
            "--job.training.tokens_per_microbatch_per_dp_rank", "64"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "the estimator cannot model Transformer: aten._local_scalar_dense" in err


# -- context parallelism ---------------------------------------------------------------------


@pytest.mark.parametrize("recipe, world_size, baseline, baseline_world_size", [
    ("cp2", 2, "debugmodel", 1),  # all-gather K/V
    ("cp2_ulysses", 2, "debugmodel", 1),
    ("fsdp2_cp2", 4, "fsdp2", 2),
])
def test_context_parallel_splits_the_sequence(recipe, world_size, baseline, baseline_world_size):
    """CP ranks hold half of every sequence of the same global batch: the dense layers are
    sharded over dp_shard x cp, and the activations per rank drop."""
    run = debug_run(recipe)
    expected = parameter_bytes(run) // world_size
    result = estimate(run, world_size)
    assert result.parameters == expected
    assert result.optimizer_state == 2 * expected
    whole = estimate(debug_run(baseline), baseline_world_size)
    # Everything per token halves; the all-gather backend also keeps the gathered K/V.
    assert 0.5 < result.activations / whole.activations < 0.6


# -- pipeline parallelism --------------------------------------------------------------------


def test_in_flight_microbatches_follow_the_schedules_warmup():
    assert in_flight("GPipe", 0, 2, [0], 8) == [8]
    assert [in_flight("1F1B", r, 4, [r], 8) for r in range(4)] == [[4], [3], [2], [1]]
    assert in_flight("1F1B", 0, 4, [0], 2) == [2]  # never more than the step's microbatches
    # Interleaved, pp 2 x 2 stages per rank, 4 microbatches: rank 0 warms up (2-1)*2 + 2*1 = 4
    # chunks (stage 0, 0, 2, 2) and runs one more forward (stage 0) before its first backward.
    assert in_flight("Interleaved1F1B", 0, 2, [0, 2], 4) == [3, 2]
    assert in_flight("Interleaved1F1B", 1, 2, [1, 3], 4) == [2, 1]
    assert in_flight("LoopedBFS", 1, 2, [1, 3], 4) == [4, 4]


def _stage_parameter_bytes(run, modules: tuple) -> int:
    with torch.device("meta"):
        model = Transformer(run.job.model)
    return 4 * sum(p.numel() for name, p in model.named_parameters() if name.startswith(modules))


def test_pipeline_stages_hold_their_own_parameters_and_their_microbatches_activations():
    # 2 layers on 2 stages: stage 0 = embeddings + layer 0, stage 1 = layer 1 + norm + output.
    first = estimate(debug_run("pp2"), world_size=2, rank=0)
    last = estimate(debug_run("pp2"), world_size=2, rank=1)
    assert first.parameters == _stage_parameter_bytes(debug_run(), ("tok_embeddings", "layers.0."))
    assert last.parameters == _stage_parameter_bytes(debug_run(), ("layers.1.", "norm", "output"))
    assert first.optimizer_state == 2 * first.parameters and last.gradients == last.parameters
    assert "in flight stage 0: 2" in first.batch and "in flight stage 1: 1" in last.batch
    # GPipe keeps all 4 microbatches of stage 0 where 1F1B keeps 2: about twice the activations.
    gpipe = debug_run("pp2")
    gpipe.job.parallelism.pp_schedule = "GPipe"
    held_all = estimate(gpipe, world_size=2, rank=0)
    assert 1.7 < held_all.activations / first.activations < 2.4


def test_pipeline_with_fsdp_shards_each_stage():
    whole = estimate(debug_run("pp2"), world_size=2, rank=0)
    sharded = estimate(debug_run("pp2_fsdp2"), world_size=4, rank=0)
    assert sharded.parameters == whole.parameters // 2
    assert sharded.activations < whole.activations  # half the microbatch rows per rank


# -- every shipped recipe ----------------------------------------------------------------------

RECIPES = Path(__file__).parents[3] / "recipes"
# What the estimator refuses by design (config/validation.py validate_estimate), in one line.
REFUSED = {"recipes.llama3:pp2_tp2": "the estimator models pipeline stages with data parallelism",
           "recipes.llama3:pp2_fsdp2_tp2": "the estimator models pipeline stages with data parallelism"}


def shipped_recipes() -> list[str]:
    """Every recipe function of recipes/*.py: a public function defined there whose parameters the
    command line can fill (none, or recipe.RECIPE_PARAMETERS: recipes.hf's)."""
    names = []
    for path in sorted(RECIPES.glob("*.py")):
        module = importlib.import_module(f"recipes.{path.stem}")
        for name, function in inspect.getmembers(module, inspect.isfunction):
            required = [p for p, parameter in inspect.signature(function).parameters.items()
                        if parameter.default is inspect.Parameter.empty]
            if function.__module__ == module.__name__ and not name.startswith("_") and \
                    set(required) <= set(RECIPE_PARAMETERS):
                names.append(f"{module.__name__}:{name}")
    return names


def smallest_world_size(run) -> int:
    """The smallest world size the recipe's degrees fit (``dp_shard=-1`` takes what is left)."""
    for world_size in range(1, 257):
        try:
            validate_job(run.job, world_size=world_size, max_steps=run.trainer.get("max_steps"))
            return world_size
        except ConfigError:
            continue
    raise AssertionError(f"no world size up to 256 fits {run.name}'s degrees")


def fewer_layers(run, keep: int = 1) -> None:
    """Cut the model to ``keep`` layers, more where its layers differ (an MoE one after DeepSeek's
    dense ones; one of each attention kind ``layer_types`` lists): the estimate runs the same code for
    every layer of a kind, and the sweep stays cheap. Pipeline recipes keep their layers (their split
    needs them)."""
    model = run.job.model
    if run.job.parallelism.pp > 1:
        return
    n = min(model.n_layers, max(keep, getattr(model, "n_dense_layers", 0) + 1))
    types = getattr(model, "layer_types", None)
    if types is not None:
        kinds = list(dict.fromkeys(types))
        n = min(model.n_layers, max(n, len(kinds)))
        model.layer_types = (kinds + [types[-1]] * n)[:n]
    model.n_layers = n


@pytest.fixture(scope="module")
def hf_recipe_values(tmp_path_factory):
    """recipes.hf's parameters: a tiny Qwen 3 folder and a prepared SFT shard set."""
    pytest.importorskip("transformers", reason="tiny Hugging Face folders are saved by transformers")
    from tests.hf_folders import save_hf_model
    from titan_lightning.testing.sft_shards import cached_synthetic_set

    folder = tmp_path_factory.mktemp("hf")
    save_hf_model(folder, "qwen3")
    return {"initial_load_path": str(folder), "dataset_path": str(cached_synthetic_set())}


def test_sft_estimate_models_document_masking_as_the_run_trains(hf_recipe_values):
    """recipes.hf:sft trains block_causal with per-document positions: the fake batch carries document
    boundaries. sdpa holds a dense [B, 1, S, S] mask that varlen never builds; flex (no backward on
    CPU) is estimated as varlen's kernel, which saves the same output and log-sum-exp."""
    activations = {}
    for attention in ("sdpa", "varlen", "flex"):
        run = build_run("recipes.hf:sft", hf_recipe_values)
        assert (run.job.model.mask, run.job.model.positions) == ("block_causal", "per_document")
        run.job.model.attention = attention
        activations[attention] = estimate(run, 1).activations
        assert run.job.model.attention == attention  # the job is left as it was
    t = run.job.training
    assert activations["sdpa"] - activations["varlen"] >= t.microbatch_size * t.seq_len**2  # the bool mask
    assert activations["flex"] == activations["varlen"]


@pytest.mark.slow  # the sweep: ~25 s of CPU for its 85 recipes (0.1-1.5 s each), out of the inner loop
@pytest.mark.parametrize("recipe", shipped_recipes())
def test_estimate_runs_on_every_shipped_recipe(recipe, request):
    """At the smallest world size the recipe's degrees fit, with its attention, masking, MoE, CP, PP,
    activation checkpointing and compile settings as shipped (recipes.hf:sft: block_causal with
    per-document positions, and varlen / flex as a GPU run would set them)."""
    values = request.getfixturevalue("hf_recipe_values") if recipe.startswith("recipes.hf:") else None
    run = build_run(recipe, values)
    fewer_layers(run)
    world_size = smallest_world_size(run)
    if recipe in REFUSED:
        with pytest.raises(ConfigError, match=REFUSED[recipe]):
            estimate(run, world_size)
        return
    result = estimate(run, world_size)
    assert result.parameters > 0 and result.activations > 0 and result.peak >= result.static - result.gradients


def _materialized(run):
    """``run``'s model as a run trains it: real tensors on one process (the init drawn)."""
    module = run.module
    with torch.device("meta"):
        module.model = module.build_model()
    module.materialize(torch.device("cpu"))
    return module.model


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_frozen_reference_is_counted_as_a_second_model_sharded_like_the_policy():
    """DPO with ``preference.reference="frozen"`` at dp_shard 2: the rank holds the policy's shards
    (their gradients and AdamW's state) and a frozen copy's shards and buffers, whose forward runs
    in each step; the precomputed reference holds neither, so its peak is lower by at least the copy."""
    from recipes.tests import features

    model = _materialized(features.llama3_dpo())
    params, buffers = _nbytes(model.parameters()), _nbytes(model.buffers())
    world_size = 2
    frozen = estimate(features.llama3_dpo_fsdp2_frozen(), world_size)
    assert frozen.parameters == 2 * params // world_size
    assert frozen.gradients == params // world_size
    assert frozen.optimizer_state == 2 * params // world_size
    assert frozen.buffers == 2 * buffers  # (RoPE's, whole on every rank)
    run = features.llama3_dpo_fsdp2_frozen()
    run.job.preference.reference = "precomputed"
    precomputed = estimate(run, world_size)
    assert frozen.peak - precomputed.peak >= params // world_size + buffers


def test_adapters_on_the_routed_experts_are_counted_with_their_gradients_and_optimizer_state():
    """LoRA on every linear and on the routed experts' tensors (``lora.target_parameters``) at
    dp_shard 2 x EP2: the base and the adapters sharded over the 2 ranks, gradients and AdamW's
    state the adapters' alone, the experts' among them."""
    from recipes.tests import models

    model = _materialized(models.qwen3_moe_lora())
    adapters = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    experts = [p for name, p in adapters if ".experts." in name]
    assert experts and _nbytes(experts) < _nbytes(p for _, p in adapters)
    params, trained = _nbytes(model.parameters()), _nbytes(p for _, p in adapters)
    world_size = 2
    result = estimate(models.qwen3_moe_lora_fsdp2_ep2(), world_size)
    assert result.parameters == params // world_size
    assert result.gradients == trained // world_size
    assert result.optimizer_state == 2 * trained // world_size


def test_the_reference_forward_with_adapters_off_is_part_of_the_step():
    """DPO with LoRA and ``preference.reference="adapters_off"``: no second model (the same parameters,
    gradients and optimizer state as the precomputed reference), and each step's reference forward,
    run after the policy's while its activations are held, raises the peak."""
    from recipes.tests import features
    from titan_lightning.config.lora import LoRAConfig

    results = {}
    for reference in ("precomputed", "adapters_off"):
        run = features.llama3_dpo_fsdp2_frozen()
        run.job.lora, run.job.preference.reference = LoRAConfig(rank=4, alpha=8.0), reference
        results[reference] = estimate(run, 2)
    precomputed, off = results["precomputed"], results["adapters_off"]
    assert off.static == precomputed.static
    assert off.peak > precomputed.peak
