"""QLoRA under FSDP2 (parallel/nf4.py, lora/layer.py ``quantize_base_nf4``): the NF4 base is
sharded on its rows, each rank's block the rows of the whole weight quantized as one process
quantizes it (from a Hugging Face folder here; from the init in the features suite, whose
``llama3_qlora_fsdp2_accumulation`` trains as the one-process run); adapter-only checkpoints resume
exactly; the layouts an NF4 base cannot take are refused before launch in one line."""

import pytest
import torch
import torch.distributed as dist

from titan_lightning.config import ConfigError
from titan_lightning.config.lora import LoRAConfig
from titan_lightning.lora import base_only, lora_layers
from titan_lightning.parallel.nf4 import is_nf4, local_rows, sharded_nf4

from tests.hf_folders import folder_and_conversations, save_hf_model

pytest.importorskip("torchao", reason="QLoRA's NF4 is torchao's (a project dependency; this checks its install)")
pytest.importorskip("transformers", reason="writes the Hugging Face folder; not a project dependency")

# A folder whose every adapted weight splits into whole NF4 scale blocks on 2 ranks.
WIDE = dict(hidden_size=256, intermediate_size=256)


def _qlora_module(folder):
    from titan_lightning.pretrained import read_hf_model

    hf = read_hf_model(folder)
    module = hf.module_class(hf.job_class(model=hf.args, lora=LoRAConfig(rank=4, alpha=8.0, quantize_base="nf4")))
    with torch.device("meta"):
        module.model = module.build_model()
    return module, hf.module_class.hf_adapter(hf.args)


def test_a_sharded_nf4_base_loads_each_ranks_rows_of_the_one_process_quantization(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    from titan_lightning.parallel.fake import init_fake_process_group
    from titan_lightning.parallel.fsdp import apply_fsdp

    folder = tmp_path / "hf"
    save_hf_model(folder, "llama", **WIDE)
    one, adapter = _qlora_module(folder)
    one.materialize(torch.device("cpu"))
    with base_only(one.model) as base:
        adapter.load_into(base, folder)
    whole = {name: layer.weight.get_original_weight() for name, layer in lora_layers(one.model)}
    init_fake_process_group(1, 2)  # (rank 1 of 2: its rows start past the first half)
    try:
        sharded, adapter = _qlora_module(folder)
        apply_fsdp(sharded.model, init_device_mesh("cpu", (2,)), param_dtype=torch.float32,
                   reduce_dtype=torch.float32)
        sharded.materialize(torch.device("cpu"))
        with base_only(sharded.model) as base:
            adapter.load_into(base, folder)
        layers = dict(lora_layers(sharded.model))
        assert layers.keys() == whole.keys()
        for name, layer in layers.items():
            assert sharded_nf4(layer.weight) and is_nf4(layer.weight.to_local())
            start, rows = local_rows(layer.weight)
            assert (start, rows) == (whole[name].shape[0] // 2, whole[name].shape[0] // 2)
            assert torch.equal(layer.weight.to_local().get_original_weight(), whole[name][start:start + rows]), name
            assert layer.lora_a.weight.requires_grad and not layer.weight.requires_grad
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("degrees,message", [
    ({"dp_shard": 2},
     r"with parallelism.dp_shard=2: layers.0.attention.wq.weight \[128, 128\] has 128 rows and 1 NF4 scale blocks"),
    ({"dp_shard": 1, "dp_replicate": 2}, r"with parallelism.dp_replicate=2: .* sharded by FSDP2 / HSDP"),
    ({"dp_shard": 1, "tp": 2}, r"with parallelism.tp=2: .* sharded by FSDP2 / HSDP \(dp_shard\) alone"),
], ids=["dp_shard_splitting_scale_blocks", "ddp", "tp"])
def test_a_layout_an_nf4_base_cannot_take_is_refused_before_launch_in_one_line(degrees, message):
    from recipes.tests import features
    from titan_lightning.config import validate_job
    from titan_lightning.recipe import on_layout

    run = on_layout(features.llama3_lora(), **degrees)  # (width 128: one NF4 scale block in each attention weight)
    run.job.lora.quantize_base = "nf4"
    with pytest.raises(ConfigError, match=rf"^lora.quantize_base='nf4' {message}") as err:
        validate_job(run.job, world_size=2, max_steps=3, device_type="cpu")
    assert "\n" not in str(err.value)


def test_dp_shard_minus_one_resolved_at_launch_is_checked_before_fsdp_shards_the_nf4_base():
    """parallelism.dp_shard=-1 is the world's rest, known at launch only: apply_fsdp refuses an NF4
    weight whose scale blocks the ranks cannot share, in the pre-launch check's words."""
    from recipes.tests import features
    from torch.distributed.device_mesh import init_device_mesh

    from titan_lightning.parallel.fake import init_fake_process_group
    from titan_lightning.parallel.fsdp import apply_fsdp

    module = features.llama3_lora().module  # (width 128: one NF4 scale block in each attention weight)
    module.job.lora.quantize_base = "nf4"
    with torch.device("meta"):
        model = module.build_model()
    init_fake_process_group(0, 2)
    try:
        with pytest.raises(ValueError, match=r"^lora.quantize_base='nf4' with parallelism.dp_shard=2: "
                                             r"layers.0.attention.wq.weight \[128, 128\] has 128 rows and 1 NF4"):
            apply_fsdp(model, init_device_mesh("cpu", (2,)), param_dtype=torch.float32, reduce_dtype=torch.float32)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.multi_process
def test_qlora_of_a_folder_under_fsdp2_checkpoints_its_adapters_resumes_exactly_and_exports_the_merged_model(tmp_path):
    """recipes.hf:qlora at dp_shard 2 (gloo): the checkpoint holds the adapters and their optimizer
    state alone (no NF4 base); a new set of processes, the base quantized from the folder again,
    repeats steps 3-4 bitwise and exports the same folders; the merged export is the dequantized NF4
    base plus the exported adapters' update."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from torchao.dtypes.nf4tensor import to_nf4

    from titan_lightning.testing.launch import launch
    from titan_lightning.trainer import RUN_DIR_ENV

    folder, data = folder_and_conversations(tmp_path, "llama", **WIDE)

    def fit(out: str, *extra: str) -> dict:
        argv = ["fit", "--recipe", "recipes.hf:qlora", "--job.checkpoint.initial_load_path", str(folder),
                "--job.data.dataset_path", str(data), "--trainer.accelerator", "cpu", "--trainer.devices", "2",
                "--job.parallelism.dp_shard", "2", "--trainer.max_steps", "4", "--trainer.max_epochs", "-1",
                "--trainer.enable_progress_bar", "false", "--job.checkpoint.interval", "2",
                "--job.data.val_fraction", "0", "--job.training.tokens_per_step", "256",
                "--job.training.tokens_per_microbatch_per_dp_rank", "64", *extra]
        return launch(argv, 2, out_dir=tmp_path / out, timeout=300, env={RUN_DIR_ENV: str(tmp_path / out / "run")})

    saved = fit("save").ranks[0]
    checkpoint = tmp_path / "save" / "run" / "checkpoints" / "epoch=0-step=2.ckpt"
    keys = [k for k in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
            if k.startswith(("state_dict.", "optimizer_0.state."))]
    assert keys and all(".lora_" in k for k in keys)
    resumed = fit("resume", "--job.checkpoint.resume_from", str(checkpoint)).ranks[0]
    assert resumed["steps"] == [3, 4]
    assert (resumed["losses"], resumed["grad_norms"]) == (saved["losses"][2:], saved["grad_norms"][2:])

    def export(run: str) -> dict:
        tensors = {}
        for file in (tmp_path / run / "run" / "export_hf").rglob("*.safetensors"):
            tensors.update({f"{file.parent.name}/{k}": v for k, v in load_file(file).items()})
        return tensors

    want, got = export("save"), export("resume")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    module = "model.layers.0.self_attn.o_proj"  # (no RoPE permutation)
    a, b = (want[f"adapter/base_model.model.{module}.lora_{x}.weight"] for x in "AB")
    base = to_nf4(load_file(folder / "model.safetensors")[f"{module}.weight"], 64, 256).get_original_weight()
    merged = next(v for k, v in want.items() if k.endswith(f"{module}.weight") and not k.startswith("adapter/"))
    torch.testing.assert_close(merged, base + 32.0 / 16 * (b @ a), rtol=1e-6, atol=1e-6)  # (recipes.hf:lora's r, alpha)


@pytest.mark.slow
@pytest.mark.multi_process
def test_compiled_fully_checkpointed_qlora_under_fsdp2_trains_as_eager(tmp_path):
    """llama3_qlora_fsdp2_accumulation (gloo, 2 ranks) with compiled blocks and full activation
    checkpointing, the checkpoint eager around each compiled block (parallel/compile.py), FSDP2's
    hooks outside both: the losses of the eager run."""
    from titan_lightning.testing.launch import launch
    from titan_lightning.trainer import RUN_DIR_ENV

    losses = {}
    for name, extra in (("eager", ()), ("compiled", ("--job.compile.enable", "true",
                                                     "--job.activation_checkpoint.mode", "full"))):
        argv = ["fit", "--recipe", "recipes.tests.features:llama3_qlora_fsdp2_accumulation", "--trainer.accelerator",
                "cpu", "--trainer.devices", "2", "--trainer.enable_progress_bar", "false", *extra]
        result = launch(argv, 2, out_dir=tmp_path / name, timeout=300, env={RUN_DIR_ENV: str(tmp_path / name / "run")})
        losses[name] = result.ranks[0]["losses"]
    assert len(losses["eager"]) == 3
    torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-6, atol=1e-6)


def test_the_estimate_counts_the_nf4_base_and_the_adapters_as_a_run_stores_them():
    """At dp_shard 2, rank 0's parameters: each NF4 weight's 4-bit values (a byte per 2), its int8
    block scales and their fp32 scales (sharded on their rows), the mean of its scales and NF4's
    16-value table (whole on every rank); the rest as stored (the frozen base in the compute dtype),
    sharded. Gradients and AdamW's state: the adapters' alone."""
    from recipes.tests import features
    from titan_lightning.estimate import estimate
    from titan_lightning.recipe import build_run

    module = features.llama3_qlora().module  # (the model a run trains, real tensors on one process)
    with torch.device("meta"):
        module.model = module.build_model()
    module.materialize(torch.device("cpu"))
    params = list(module.model.parameters())
    nf4 = [p for p in params if is_nf4(p)]
    assert len(nf4) == 2 * 7  # (every linear of 2 layers)
    sharded = sum(t.numel() * t.element_size() for p in nf4
                  for t in (p.quantized_data, p.quantized_scalers, p.quantization_factor))
    whole = sum(p.scaler_mean.numel() * 4 + p.nf4.numel() * 4 for p in nf4)
    dense = sum(p.numel() * p.element_size() for p in params if not is_nf4(p))
    adapters = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    assert sharded < sum(p.numel() for p in nf4) * 0.6  # (4 bits a weight and its scales)
    world_size = 2
    result = estimate(build_run("recipes.tests.features:llama3_qlora_fsdp2_accumulation"), world_size)
    assert result.parameters == (sharded + dense) // world_size + whole
    assert result.gradients == adapters // world_size
    assert result.optimizer_state == 2 * adapters // world_size


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_the_estimate_of_an_adapter_run_whose_base_is_frozen_in_bf16(quantize):
    """A GPU run's storage (mixed_precision_param bfloat16: the frozen base in bf16) on one process,
    LoRA and QLoRA: the estimator casts the meta model as the run does (a cast under its fake mode
    could not be swapped in: "Couldn't swap Embedding.weight", before any recipe on a GPU launched)."""
    from recipes.tests import features
    from titan_lightning.estimate import estimate

    def run():
        r = features.llama3_lora()
        r.job.training.mixed_precision_param = "bfloat16"
        r.job.lora.quantize_base = quantize
        return r

    module = run().module
    with torch.device("meta"):
        module.model = module.build_model()
    module.materialize(torch.device("cpu"))
    params = list(module.model.parameters())
    assert {p.dtype for p in params if not p.requires_grad and not is_nf4(p)} == {torch.bfloat16}
    stored = sum(t.numel() * t.element_size() for p in params
                 for t in ((p.quantized_data, p.quantized_scalers, p.quantization_factor, p.scaler_mean, p.nf4)
                           if is_nf4(p) else (p,)))
    adapters = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    result = estimate(run(), 1)
    assert (result.parameters, result.gradients, result.optimizer_state) == (stored, adapters, 2 * adapters)
