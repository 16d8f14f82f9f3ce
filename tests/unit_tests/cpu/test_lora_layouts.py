"""LoRA at every layout (titan_lightning/lora/parallel.py): the routed experts' adapters (PEFT's
``target_parameters``), the tensor-parallel styles of a linear with adapters, and the layouts refused
before launch. That each layout equals one process is the suites' (features: llama3_lora_*, models:
qwen3_moe_lora_fsdp2_ep2)."""

import shutil

import pytest
import torch
from torch import nn

from titan_lightning.config import ConfigError
from titan_lightning.config.lora import LoRAConfig
from titan_lightning.lora import LoRALinear, base_only, expert_adapters
from titan_lightning.testing.threaded import run_threaded

from tests.hf_folders import VOCAB, save_hf_model


def _experts_ours(folder, lora: LoRAConfig):
    from test_lora import _ours

    return _ours(folder, lora)


# (model_type, target_modules, config overrides): DeepSeek V3 with every projection of its latent attention
# (compressed queries: q_a_proj, q_b_proj), its router, a dense layer before the MoE one.
EXPERT_FAMILIES = [("qwen3_moe", "q_proj,v_proj", {}), ("gpt_oss", "q_proj,v_proj", {}),
                   ("deepseek_v3", "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate", dict(q_lora_rank=16))]


@pytest.mark.parametrize("model_type,targets,overrides", EXPERT_FAMILIES, ids=[f[0] for f in EXPERT_FAMILIES])
def test_expert_adapters_step_one_loss_and_gradients_equal_peft_target_parameters(model_type, targets, overrides,
                                                                                   tmp_path):
    """Adapters on the attention and both expert tensors against PEFT's ParamWrapper on transformers'
    fused experts ([E, out, in] for Qwen3-MoE and DeepSeek V3; gpt-oss's [E, in, out], gate and up
    interleaved): the same loss, the same gradients of every factor, and the exports' logits."""
    peft = pytest.importorskip("peft", reason="PEFT is the reference for LoRA (setup.cfg's dev extra)")
    folder = tmp_path / "hf"
    theirs = save_hf_model(folder, model_type, **overrides).train()
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=targets, target_parameters="gate_up_proj,down_proj")
    ours, adapter = _experts_ours(folder, lora)
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=targets.split(","),
                                                         target_parameters=["mlp.experts.gate_up_proj",
                                                                            "mlp.experts.down_proj"]))
    adapted = expert_adapters(ours)
    assert adapted and all(set(experts.lora_a) == {"gate_up_proj", "down_proj"} for _, experts in adapted)

    def wrapper(name: str, tensor: str):  # PEFT nests its wrappers: the first target innermost
        outer = theirs.base_model.model.model.layers[int(name.split(".")[1])].mlp.experts  # ('layers.1.moe.experts')
        return outer.base_layer if tensor == "gate_up_proj" else outer

    def peft_a(a: torch.Tensor) -> torch.Tensor:  # ours [E, r, in] -> PEFT's [E * r, in]
        return a.reshape(-1, a.shape[-1])

    def peft_b(b: torch.Tensor) -> torch.Tensor:  # ours [E, out, r] -> PEFT's [out, r * E]
        return b.permute(1, 2, 0).reshape(b.shape[1], -1)

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B off zero: every factor changes the output and gets a gradient
        for _, layer in _linears(ours):
            layer.lora_b.weight.copy_(0.1 * torch.randn(layer.lora_b.weight.shape, generator=g))
        for layer_name, experts in adapted:
            for name in experts.lora_a:
                experts.lora_b[name].copy_(0.1 * torch.randn(experts.lora_b[name].shape, generator=g))
                w = wrapper(layer_name, name)
                w.lora_A["default"].weight.copy_(peft_a(experts.lora_a[name]))
                w.lora_B["default"].weight.copy_(peft_b(experts.lora_b[name]))
        names = _hf_names(ours, adapter)
        for name, layer in _linears(ours):
            their = theirs.base_model.model.get_submodule(names[name])
            their.lora_A["default"].weight.copy_(layer.lora_a.weight)
            their.lora_B["default"].weight.copy_(adapter.to_hf({f"{name}.weight": layer.lora_b.weight})[
                f"{names[name]}.weight"])
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)

    def step_one(logits: torch.Tensor) -> torch.Tensor:
        loss = _cross_entropy(logits, tokens)
        loss.backward()
        return loss

    torch.testing.assert_close(step_one(ours(tokens)), step_one(theirs(input_ids=tokens).logits), rtol=0, atol=1e-6)
    for layer_name, experts in adapted:
        for name in experts.lora_a:
            w = wrapper(layer_name, name)
            assert experts.lora_b[name].grad.abs().sum() > 0
            torch.testing.assert_close(peft_a(experts.lora_a[name].grad), w.lora_A["default"].weight.grad,
                                       rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(peft_b(experts.lora_b[name].grad), w.lora_B["default"].weight.grad,
                                       rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in ours.parameters() if not p.requires_grad)

    # The exports: PEFT's folder (the experts' factors as its ParamWrapper saves them) loads on the base
    # folder with our logits, and so does the merged folder (every expert's W + alpha / r * B A).
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from titan_lightning.lora.export import MergedState, peft_state, write_peft_folder

    write_peft_folder(tmp_path / "adapter", peft_state(ours, adapter), lora, str(folder), adapter)
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                                            tmp_path / "adapter").eval()
    merged_folder = tmp_path / "merged"
    merged_folder.mkdir()
    shutil.copy(folder / "config.json", merged_folder)
    save_file({k: v.contiguous() for k, v in adapter.to_hf(dict(MergedState(ours))).items()},
              str(merged_folder / "model.safetensors"), metadata={"format": "pt"})
    merged = AutoModelForCausalLM.from_pretrained(merged_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ours(tokens)
        torch.testing.assert_close(loaded(input_ids=tokens).logits, logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=tokens).logits, logits, rtol=1e-5, atol=1e-5)
        for _, experts in adapted:  # (the experts' adapters alone off: they count)
            experts.adapters_on = False
        assert (ours(tokens) - logits).abs().max() > 1e-3


def _linears(model):
    from titan_lightning.lora import lora_layers

    return list(lora_layers(model))


def _hf_names(model, adapter):
    from titan_lightning.lora.targets import hf_linears

    return hf_linears(model, adapter)


def _cross_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _adapted_pair(rank: int, world_size: int, style: str) -> dict:
    """A linear with adapters (B off zero) under ``style`` on ``world_size`` thread ranks against the
    same linear on one: each output block and the full gradients of A and B."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from titan_lightning.parallel.tensor_styles import STYLES, Target

    features = (12, 8) if style == "rowwise" else (8, 12)
    x = torch.randn(3, features[0], generator=torch.Generator().manual_seed(1))
    one, tp = (_random_lora(*features) for _ in range(2))
    name, _, parts = style.partition(":")
    parallelize_module(tp, init_device_mesh("cpu", (world_size,)),
                       STYLES[name].parallel_style(Target(tp, False, False, int(parts) if parts else None)),
                       src_data_rank=None)
    want = one(x)
    if name == "rowwise":  # each rank its features of the input; the output summed over the ranks
        got = tp(x.chunk(world_size, dim=-1)[rank])
    else:  # each rank its rows of every block of the output ([q_r, k_r, v_r] for colwise_fused:3)
        blocks = int(parts or 1)
        want = torch.cat([b.chunk(world_size, dim=-1)[rank] for b in want.chunk(blocks, dim=-1)], dim=-1)
        got = tp(x)
    got.square().sum().backward()  # (rowwise: every rank's whole output; colwise: the ranks' parts sum to it)
    one(x).square().sum().backward()
    errors = {"out": ((got - want).abs().max() / want.abs().max()).item()}
    for child in ("lora_a", "lora_b"):
        grad, reference = getattr(tp, child).weight.grad, getattr(one, child).weight.grad
        errors[child] = ((grad.full_tensor() - reference).abs().max() / reference.abs().max()).item()
        errors[f"{child} placement"] = str(grad.placements[0]) == str(getattr(tp, child).weight.placements[0])
    return errors


def _random_lora(in_features: int, out_features: int) -> LoRALinear:
    """A frozen linear with adapters, every value drawn (B off zero), the same on every call."""
    g = torch.Generator().manual_seed(0)
    layer = LoRALinear(in_features, out_features, rank=2, alpha=4.0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    layer.weight.requires_grad_(False)
    return layer


@pytest.mark.parametrize("style", ["colwise", "rowwise", "colwise_fused:3"])
def test_a_linear_with_adapters_under_tp_computes_and_trains_as_one_process(style):
    """The style of a LoRALinear's plan entry shards A and B with the base (AdaptedLinearParallel):
    the same outputs, A's and B's full gradients equal one process's, each placed as its weight."""
    for rank, errors in enumerate(run_threaded(_adapted_pair, 2, style=style)):
        assert errors["out"] < 1e-6, f"rank {rank}: {errors}"
        for child in ("lora_a", "lora_b"):
            assert errors[child] < 1e-6 and errors[f"{child} placement"], f"rank {rank} {child}: {errors}"


def _moe_with_adapters(grouped: bool, family=None):
    """An MoE layer whose experts carry adapters on both tensors, B off zero; inside a module, as in a model."""
    from titan_lightning.lora.experts import add_expert_adapters
    from titan_lightning.models.common.moe import MoE, MoEArgs

    torch.manual_seed(0)
    model = nn.Module()
    model.moe = MoE(16, MoEArgs(num_experts=4, top_k=2, hidden_dim=8, use_grouped_mm=grouped, load_balance_coeff=None))
    for p in model.parameters():
        nn.init.normal_(p, std=0.2)
    add_expert_adapters(model, LoRAConfig(rank=2, alpha=4.0, target_parameters="down_proj,gate_up_proj"), family)
    for factor in (*model.moe.experts.lora_a.values(), *model.moe.experts.lora_b.values()):
        nn.init.normal_(factor, std=0.2)
    return model


@pytest.mark.parametrize("family", [None, "gpt-oss"])
def test_expert_adapters_compute_the_merged_experts_on_the_loop_and_the_grouped_gemm(family):
    """Each expert computes with W + alpha / r * B A (gate_up_proj's rows split into w1 and w3 as the
    family's tensor holds them: gate rows then up rows, or interleaved), on either kernel."""
    from titan_lightning.models.common.moe import CPU_GROUPED_MM

    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    loop = _moe_with_adapters(False, family)
    experts = loop.moe.experts
    assert list(experts.lora_a) == ["gate_up_proj", "down_proj"]  # (PEFT's nesting order: the tensors' own)
    scale = 2.0
    update = {name: torch.bmm(experts.lora_b[name], experts.lora_a[name]) * scale for name in experts.lora_a}
    gate, up = ((update["gate_up_proj"][:, 0::2], update["gate_up_proj"][:, 1::2]) if family
                else update["gate_up_proj"].chunk(2, dim=1))
    merged = _moe_with_adapters(False, family)
    with torch.no_grad(), base_only(merged):  # (the base alone: its own state dict, no factor)
        assert not any("lora" in key for key in merged.state_dict())
        for name, delta in (("w1", gate), ("w3", up), ("w2", update["down_proj"])):
            getattr(merged.moe.experts, name).add_(delta)
        merged.moe.experts.adapters_on = False
    want = merged.moe(x)
    torch.testing.assert_close(loop.moe(x), want, rtol=1e-5, atol=1e-6)
    if CPU_GROUPED_MM:
        torch.testing.assert_close(_moe_with_adapters(True, family).moe(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe, change, message", [
    ("recipes.tests.features:llama3_lora", dict(target_parameters=["gate_up_proj"]), "has no routed experts"),
    ("recipes.tests.models:qwen3_moe_lora", dict(tp=2, sequence_parallel=True), "set parallelism.ep to a multiple"),
])
def test_a_layout_expert_adapters_do_not_take_is_refused_before_launch_in_one_line(recipe, change, message):
    from dataclasses import replace

    from titan_lightning.lora.parallel import check_lora_layout
    from titan_lightning.models.common.decoder import decoder_class
    from titan_lightning.recipe import build_run

    job = build_run(recipe).job
    lora = {k: v for k, v in change.items() if k == "target_parameters"}
    degrees = {k: v for k, v in change.items() if k != "target_parameters"}
    job = replace(job, lora=replace(job.lora, **lora), parallelism=replace(job.parallelism, **degrees))
    with torch.device("meta"):
        model = decoder_class(type(job.model))(job.model)
    with pytest.raises(ConfigError, match=message) as error:
        check_lora_layout(job, model)
    assert "\n" not in str(error.value) and "lora.target_parameters=" in str(error.value)


@pytest.mark.parametrize("fields, message", [
    (dict(target_parameters="gate_proj"), "lora.target_parameters=gate_proj: each of gate_up_proj, down_proj"),
    (dict(target_parameters="down_proj,down_proj"), "at most once"),
    (dict(target_parameters="down_proj", dropout=0.1), "lora.dropout=0.1 with lora.target_parameters"),
])
def test_target_parameters_name_the_experts_tensors(fields, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(rank=4, **fields)


@pytest.mark.slow
@pytest.mark.multi_process
def test_adapter_only_checkpoints_of_pipeline_stages_resume_exactly(tmp_path):
    """PP2 (gloo): each stage saves its adapters and their optimizer state alone; a new set of
    processes resumes from step 2 and repeats step 3 bitwise."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from titan_lightning.recipe import build_run
    from titan_lightning.testing.launch import launch
    from titan_lightning.trainer import RUN_DIR_ENV

    def fit(recipe: str, out: str, *extra: str) -> dict:
        argv = ["fit", "--recipe", f"recipes.tests.features:{recipe}", "--trainer.accelerator", "cpu",
                "--trainer.devices", "2", *extra]
        return launch(argv, 2, out_dir=tmp_path / out, timeout=300, env={RUN_DIR_ENV: str(tmp_path / out / "run")})

    saved = fit("llama3_lora_pp2_every2", "save").ranks[0]
    checkpoint = tmp_path / "save" / "run" / "checkpoints" / "epoch=0-step=2.ckpt"
    keys = [k for k in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
            if k.startswith(("state_dict.", "optimizer_0.state."))]
    layers = build_run("recipes.tests.features:llama3_lora_pp2").job.model.n_layers  # (one a stage)
    assert {k.split(".layers.")[1].split(".")[0] for k in keys if ".layers." in k} == {str(i) for i in range(layers)}
    assert keys and all(".lora_" in k for k in keys)  # both stages' adapters, no base weight
    resumed = fit("llama3_lora_pp2", "resume", "--job.checkpoint.resume_from", str(checkpoint),
                  "--job.checkpoint.export_format", "hf").ranks[0]
    assert resumed["steps"] == [3]
    assert (resumed["losses"], resumed["grad_norms"]) == (saved["losses"][2:], saved["grad_norms"][2:])
    # The PEFT folder of the export holds both stages' adapters.
    exported = load_file(tmp_path / "resume" / "run" / "export_hf" / "adapter" / "adapter_model.safetensors")
    assert {k.split(".layers.")[1].split(".")[0] for k in exported} == {str(i) for i in range(layers)}
