"""LoRA (``job.lora``, titan_lightning/lora/): the adapters compute what PEFT's compute on the
transformers model of the same folder (step-1 loss and every adapter's gradient, fp32, CPU); a
fresh adapter computes the base model; only adapters train, the base is frozen in the compute dtype
with no optimizer state; gradient accumulation trains as one batch does; a run from a
Hugging Face folder checkpoints its adapters alone, resumes exactly, and exports a PEFT adapter
folder that PEFT loads onto the base with the merged export's logits."""

import math
from pathlib import Path

import pytest
import torch

import sft_loss_cases as cases
from test_sft_loss import _assert_same
from titan_lightning.config import ConfigError
from titan_lightning.config.lora import LoRAConfig
from titan_lightning.lora import base_only, lora_layers
from titan_lightning.lora.export import peft_state
from titan_lightning.lora.targets import hf_linears
from titan_lightning.parallel.nf4 import is_nf4

from tests.hf_folders import VOCAB, folder_and_conversations, save_hf_model

transformers = pytest.importorskip("transformers", reason="the reference implementation; not a project dependency")
peft = pytest.importorskip("peft", reason="PEFT is the reference for LoRA (setup.cfg's dev extra)")


def _ours(folder: Path, lora: LoRAConfig):
    """Our model of ``folder`` with adapters, the base loaded from the folder; its family's adapter."""
    from titan_lightning.pretrained import read_hf_model

    hf = read_hf_model(folder)
    module = hf.module_class(hf.job_class(model=hf.args, lora=lora))
    model = module.build_model()
    model.init_weights(seed=3)
    adapter = hf.module_class.hf_adapter(hf.args, tie_word_embeddings=hf.tie_word_embeddings)
    with base_only(model) as base:
        adapter.load_into(base, folder)
    return model, hf.module_class.hf_adapter(hf.args)


def _cross_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _step_one_backward_agrees(ours, theirs, g: torch.Generator) -> None:
    """One batch's loss through our model and the PeftModel equal; both backward (their gradients compared after)."""
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
    loss = _cross_entropy(ours(tokens), tokens)
    loss.backward()
    their_loss = _cross_entropy(theirs(input_ids=tokens).logits, tokens)
    their_loss.backward()
    torch.testing.assert_close(loss, their_loss, rtol=0, atol=1e-6)


# (model_type, tied, target_modules): dense and tied; MoE (attention and router; the routed experts:
# test_lora_layouts.py); sliding-window layers beside global ones (Gemma 3); DeepSeek V3's latent attention
# (uncompressed queries; q_a_proj / q_b_proj: test_lora_layouts.py) and its sigmoid router.
FAMILIES = [("llama", False, "all-linear"), ("qwen3", True, "all-linear"),
            ("qwen3_moe", False, "q_proj,k_proj,v_proj,o_proj,gate"), ("gemma3_text", False, "all-linear"),
            ("deepseek_v3", False, "q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate")]


@pytest.mark.parametrize("model_type,tie,targets", FAMILIES, ids=[f[0] + ("_tied" if f[1] else "") for f in FAMILIES])
def test_step_one_loss_and_adapter_gradients_equal_peft_on_transformers(model_type, tie, targets, tmp_path):
    folder = tmp_path / "hf"
    theirs = save_hf_model(folder, model_type, tie=tie).train()
    ours, adapter = _ours(folder, LoRAConfig(rank=4, alpha=8.0, target_modules=targets))
    names = hf_linears(ours, adapter)
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=targets.split(",")
                                                         if targets != "all-linear" else targets))
    peft_modules = {name.removeprefix("base_model.model.") for name, m in theirs.named_modules()
                    if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert peft_modules == {names[name] for name, _ in lora_layers(ours)}  # the same linears

    def theirs_of(name: str, which: str) -> torch.Tensor:
        return getattr(theirs.base_model.model.get_submodule(names[name]), which)["default"].weight

    def hf_rows(name: str, b: torch.Tensor) -> torch.Tensor:  # q_proj / k_proj rows in Hugging Face's RoPE layout
        return adapter.to_hf({f"{name}.weight": b})[f"{names[name]}.weight"]

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B off zero, so every adapter changes the output and gets a gradient
        for name, layer in lora_layers(ours):
            layer.lora_b.weight.copy_(0.1 * torch.randn(layer.lora_b.weight.shape, generator=g))
            theirs_of(name, "lora_A").copy_(layer.lora_a.weight)
            theirs_of(name, "lora_B").copy_(hf_rows(name, layer.lora_b.weight))
    _step_one_backward_agrees(ours, theirs, g)
    # (Gemma 3 scales its embeddings by sqrt(dim): its adapters' gradients are ~1, five times the others',
    # and on an AVX-512 host (BLAS's other blocking) they differ from PEFT's by up to 2.6e-6, 2.5e-6 of
    # their scale; the others' stay within 2e-7 there.)
    atol = 5e-6 if model_type == "gemma3_text" else 1e-6
    for name, layer in lora_layers(ours):
        torch.testing.assert_close(layer.lora_a.weight.grad, theirs_of(name, "lora_A").grad, rtol=1e-5, atol=atol)
        torch.testing.assert_close(hf_rows(name, layer.lora_b.weight.grad), theirs_of(name, "lora_B").grad,
                                   rtol=1e-5, atol=atol)
    assert all(p.grad is None for p in ours.parameters() if not p.requires_grad)


def test_fused_linears_take_one_adapter_as_peft_s_and_export_it(tmp_path):
    """Phi-3's q, k, v (one qkv_proj in its folder) and gate, up (gate_up_proj): one A shared by the
    parts, B's rows split as the fused weight's; our PEFT export loaded into PEFT's model of the folder
    (all-linear: the same four modules a layer) gives our step-1 loss, and its gradients ours."""
    folder = tmp_path / "hf"
    theirs = save_hf_model(folder, "phi3").train()
    ours, adapter = _ours(folder, LoRAConfig(rank=4, alpha=8.0))
    layer = ours.layers["0"]
    assert layer.attention.wq.lora_a is layer.attention.wk.lora_a is layer.attention.wv.lora_a
    assert layer.feed_forward.w1.lora_a is layer.feed_forward.w3.lora_a is not layer.feed_forward.w2.lora_a
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, lora in lora_layers(ours):  # (B off zero: every adapter changes the output, A gets gradients)
            lora.lora_b.weight.copy_(0.1 * torch.randn(lora.lora_b.weight.shape, generator=g))
    state = peft_state(ours, adapter)
    assert {k.removeprefix("base_model.model.").rsplit(".", 2)[0] for k in state} == {
        name.removeprefix("base_model.model.") for name, m in theirs.named_modules()
        if isinstance(m, peft.tuners.lora.LoraLayer)} and any("qkv_proj" in k for k in state)
    assert not peft.set_peft_model_state_dict(theirs, state).unexpected_keys
    _step_one_backward_agrees(ours, theirs, g)
    with torch.no_grad():  # (our gradients in PEFT's names and layout: the export of a model holding them)
        for p in ours.parameters():
            if p.requires_grad:
                p.copy_(p.grad)
    grads = peft_state(ours, adapter)
    their_grads = {name.replace(".default", ""): p.grad for name, p in theirs.named_parameters() if p.requires_grad}
    assert grads.keys() == their_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, their_grads[key], rtol=1e-5, atol=1e-6)


def test_a_fresh_adapter_computes_the_base_model_and_draws_a_as_peft(tmp_path):
    folder = tmp_path / "hf"
    base = save_hf_model(folder, "qwen3")
    ours, _ = _ours(folder, LoRAConfig(rank=8, alpha=16.0))
    tokens = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), base(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
    for _, layer in lora_layers(ours):
        a = layer.lora_a.weight
        assert not layer.lora_b.weight.any() and a.std() > 0
        assert a.abs().max() <= 1 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
    # (each A drawn from (seed, its name), as every other parameter)
    a0, a1 = [layer.lora_a.weight for _, layer in list(lora_layers(ours))[:2]]
    assert not torch.equal(a0[:, :8], a1[:, :8])


def test_only_the_adapters_train_and_the_base_is_stored_in_the_compute_dtype():
    """No fp32 copy of a frozen base under bf16 mixed precision; the adapters stay fp32 (gradients and
    optimizer state: the layout and checkpoint tests below)."""
    from recipes.tests import features

    run = features.llama3_small()
    run.job.lora = LoRAConfig(rank=4, target_modules="q_proj,v_proj")
    run.job.training.mixed_precision_param = "bfloat16"
    module = run.module
    with torch.device("meta"):
        module.model = module.build_model()
    module.materialize(torch.device("cpu"))
    trainable = {name: p.dtype for name, p in module.model.named_parameters() if p.requires_grad}
    assert set(trainable) == {f"layers.{i}.attention.{w}.lora_{x}.weight" for i in range(2) for w in ("wq", "wv")
                              for x in "ab"}
    assert set(trainable.values()) == {torch.float32}
    assert {p.dtype for p in module.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert module.model.rope_cache.dtype == torch.float32


@pytest.mark.parametrize("change,message", [
    (dict(target_modules="q_proj,qkv"), "lora.target_modules=q_proj,qkv: Llama has no linear named 'qkv'; valid: "
                                        "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj or all-linear"),
    (dict(target_modules="lm_head"), "no linear named 'lm_head'"),
])
def test_an_unknown_target_is_one_line_naming_the_valid_names(change, message):
    from recipes.tests import features
    from titan_lightning.config import validate_job

    run = features.llama3_small()
    run.job.lora = LoRAConfig(rank=4, **change)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as caught:
        validate_job(run.job, world_size=1, max_steps=1, device_type="cpu")
    assert "\n" not in str(caught.value)


def test_deepseek_v3_mlps_take_no_adapters_as_peft_reads_their_names_as_the_routed_experts(tmp_path):
    """PEFT on transformers 5 converts DeepSeek V3's gate_proj / up_proj / down_proj targets to the routed
    experts' tensors (so the dense and shared MLPs it cannot adapt, nor load adapters onto): ours refuses
    them in one line, and all-linear leaves them out."""
    folder = tmp_path / "hf"
    mlp = ["gate_proj", "up_proj", "down_proj"]
    theirs = peft.get_peft_model(save_hf_model(folder, "deepseek_v3"), peft.LoraConfig(r=4, target_modules=mlp))
    adapted = {name.rsplit(".", 1)[1] for name, m in theirs.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert adapted == {"experts", "base_layer"}  # the experts' tensors, no linear (if this fails, lift the rule)
    ours, adapter = _ours(folder, LoRAConfig(rank=4))  # (all-linear)
    assert {name.rsplit(".", 1)[1] for name in hf_linears(ours, adapter).values()} == {
        "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate"}
    from titan_lightning.pretrained import read_hf_model

    hf = read_hf_model(folder)
    job = hf.job_class(model=hf.args, lora=LoRAConfig(rank=4, target_modules="q_proj,up_proj"))
    with pytest.raises(ConfigError, match=r"lora.target_modules=q_proj,up_proj: PEFT reads 'up_proj' on DeepSeek V3 "
                                          r"as the routed experts' tensors") as caught:
        hf.module_class.check_config(job)  # (before launch: validate_job's family rules)
    assert "\n" not in str(caught.value)


def test_target_modules_on_the_command_line_as_a_comma_separated_list():
    from titan_lightning.cli import parse_run

    run = parse_run(["--recipe", "recipes.llama3:debugmodel", "--job.lora.rank", "4",
                     "--job.lora.target_modules", "q_proj,v_proj"])
    assert run.job.lora.target_modules == ["q_proj", "v_proj"]


# -- layouts: gradient accumulation trains as one step (FSDP2, PP, CP: the llama3_lora_* suite entries) ---


def test_only_adapters_get_gradients_and_accumulation_trains_as_one_batch():
    lora = {"rank": 4, "alpha": 8.0}
    one = cases.sft_run(lora=lora, steps=3)
    grads = one["steps"][-1]["grads"]
    assert set(grads) == {name for name in grads if ".lora_" in name} and len(grads) == 2 * 7 * 2  # adapters only
    assert all(norm > 0 for norm, _ in grads.values())
    _assert_same(cases.sft_run(lora=lora, steps=3, accumulate=2), one)


# -- a run from a Hugging Face folder: checkpoints, resume, exports -----------------------------------


def _fit(folder: Path, data: Path, run_dir: Path, monkeypatch, *extra: str, recipe: str = "recipes.hf:lora") -> None:
    from titan_lightning.cli import main
    from titan_lightning.trainer import RUN_DIR_ENV

    monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))
    assert main(["fit", "--recipe", recipe, "--job.checkpoint.initial_load_path", str(folder),
                 "--job.data.dataset_path", str(data), "--trainer.accelerator", "cpu", "--trainer.max_steps", "4",
                 "--trainer.max_epochs", "-1", "--trainer.enable_progress_bar", "false",
                 "--job.checkpoint.interval", "2", "--job.data.val_fraction", "0",
                 "--job.training.tokens_per_step", "256", "--job.training.tokens_per_microbatch_per_dp_rank", "128",
                 *extra]) == 0


# Phi-3: fused linears; Gemma 3's multimodal model (Gemma3ForConditionalGeneration, its language model trained): the
# adapter named as in it, loaded onto it by PeftModel; the merged export a text model.
@pytest.mark.parametrize("model_type,module", [("qwen3", "model.layers.0.self_attn.q_proj"),
                                               ("phi3", "model.layers.0.self_attn.qkv_proj"),
                                               ("gemma3", "model.language_model.layers.0.self_attn.q_proj")])
def test_a_lora_run_checkpoints_adapters_resumes_exactly_and_exports_what_peft_loads(model_type, module, tmp_path,
                                                                                     monkeypatch):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    folder, data = folder_and_conversations(tmp_path, model_type)
    _fit(folder, data, tmp_path / "run", monkeypatch)
    checkpoint = tmp_path / "run" / "checkpoints" / "epoch=0-step=2.ckpt"
    saved = [k for k in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
             if k.startswith(("state_dict.", "optimizer_0.state."))]
    assert saved and all(".lora_" in k for k in saved)  # adapters and their state alone: the base is the folder's
    _fit(folder, data, tmp_path / "resumed", monkeypatch, "--job.checkpoint.resume_from", str(checkpoint))
    for name in ("adapter/adapter_model.safetensors", "model.safetensors"):
        want, got = (load_file(tmp_path / run / "export_hf" / name) for run in ("run", "resumed"))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name

    export = tmp_path / "run" / "export_hf"
    assert f"base_model.model.{module}.lora_A.weight" in load_file(
        export / "adapter" / "adapter_model.safetensors")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with_adapters = peft.PeftModel.from_pretrained(base, export / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        logits = with_adapters(input_ids=tokens).logits
        torch.testing.assert_close(logits, merged(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
        with with_adapters.disable_adapter():
            assert (logits - with_adapters(input_ids=tokens).logits).abs().max() > 1e-3  # the adapters trained

    # generate / chat on the last checkpoint: the adapters it holds on the run's base folder
    from titan_lightning.cli import parse_run
    from titan_lightning.generate import find_model

    last = tmp_path / "run" / "checkpoints" / "epoch=0-step=4.ckpt"
    found = find_model(str(last), ["--recipe", "recipes.hf:lora", "--job.checkpoint.initial_load_path", str(folder),
                                   "--job.data.dataset_path", str(data)], parse_run)
    model = found.load(torch.device("cpu"), torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model.output(model(tokens)), logits, rtol=1e-5, atol=1e-5)

    # recipes.hf:qlora: the same run on the NF4 base; its merged export (the dequantized base plus the
    # update) is what generate computes on its checkpoint (the adapters on the base quantized as it loads)
    _fit(folder, data, tmp_path / "qlora", monkeypatch, "--trainer.max_steps", "2", recipe="recipes.hf:qlora")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qlora" / "export_hf", dtype=torch.float32)
    found = find_model(str(tmp_path / "qlora" / "checkpoints" / "epoch=0-step=2.ckpt"),
                       ["--recipe", "recipes.hf:qlora", "--job.checkpoint.initial_load_path", str(folder),
                        "--job.data.dataset_path", str(data)], parse_run)
    model = found.load(torch.device("cpu"), torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model.output(model(tokens)), merged.eval()(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)


# -- QLoRA: an NF4 base ----------------------------------------------------------------------------


def test_qlora_stores_the_base_as_nf4_loads_into_it_and_computes_the_dequantized_base(tmp_path):
    """The adapted layers' frozen weights are torchao NF4 (4 bits a weight and a scale per 64), a load
    re-quantizes what it copies in, and the forward equals the LoRA model whose base is the dequantized
    NF4 (adapters and their gradients alike)."""
    from titan_lightning.pretrained import read_hf_model

    folder = tmp_path / "hf"
    save_hf_model(folder, "llama")
    hf = read_hf_model(folder)
    models = []
    for quantize in ("nf4", None):
        lora = LoRAConfig(rank=4, alpha=8.0, quantize_base=quantize)
        module = hf.module_class(hf.job_class(model=hf.args, lora=lora))
        with torch.device("meta"):
            module.model = module.build_model()
        module.materialize(torch.device("cpu"))
        models.append(module.model)
    qlora, dense = models
    with base_only(qlora) as base:
        hf.module_class.hf_adapter(hf.args).load_into(base, folder)
    layers = dict(lora_layers(qlora))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        dense.load_state_dict({k: v for k, v in qlora.state_dict().items() if not k.endswith(tuple(
            f"{name}.weight" for name in layers))}, strict=False)
        for name, layer in lora_layers(dense):
            nf4 = layers[name].weight
            assert type(nf4).__name__ == "NF4Tensor" and nf4.quantized_data.numel() == layer.weight.numel() // 2
            layer.weight.copy_(nf4.get_original_weight())
            layers[name].lora_b.weight.copy_(0.1 * torch.randn(layer.lora_b.weight.shape, generator=g))
            layer.lora_b.weight.copy_(layers[name].lora_b.weight)
    from safetensors.torch import load_file
    from torchao.dtypes.nf4tensor import to_nf4

    original = load_file(folder / "model.safetensors")["model.layers.0.self_attn.o_proj.weight"]
    loaded = layers["layers.0.attention.wo"].weight  # (o_proj: no RoPE permutation)
    assert torch.equal(loaded.get_original_weight(), to_nf4(original, 64, 64).get_original_weight())
    tokens = torch.randint(0, VOCAB, (2, 12), generator=g)
    losses = [_cross_entropy(model(tokens), tokens) for model in (qlora, dense)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for name, layer in lora_layers(dense):
        torch.testing.assert_close(layers[name].lora_a.weight.grad, layer.lora_a.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("degree", ["tp"])  # (FSDP2 composes: test_qlora_fsdp.py)
def test_qlora_on_several_ranks_is_refused_before_launch(degree):
    from recipes.tests import features
    from titan_lightning.config import validate_job
    from titan_lightning.recipe import on_layout

    run = on_layout(features.llama3_small(), **{degree: 2})
    run.job.lora = LoRAConfig(rank=4, quantize_base="nf4")
    with pytest.raises(ConfigError, match=rf"lora.quantize_base='nf4' with parallelism.{degree}=2: .* one process "
                                          rf"or sharded by FSDP2"):
        validate_job(run.job, world_size=2, max_steps=1, device_type="cpu")


@pytest.mark.slow  # Inductor on CPU: ~15 s
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_a_compiled_qlora_block_keeps_no_dequantized_weight(tmp_path, checkpointing):
    """A compiled block with NF4 weights keeps no dequantized weight for the backward: traced
    together, the forward's and the backward's dequantizations became one node the partitioner
    saved (an 8B QLoRA step without checkpointing kept 13 GiB of bf16 weights on an H200, run 8; a
    70B block under a compiled full checkpoint 2.2 GiB, run 7). Under full checkpointing the compiled
    forward is checkpointed from the outside (eager) and the block keeps its inputs alone. The loss and
    the adapters' gradients are the eager model's."""
    from titan_lightning.parallel.activation_checkpoint import apply_activation_checkpointing
    from titan_lightning.parallel.compile import compile_blocks
    from titan_lightning.pretrained import read_hf_model

    folder = tmp_path / "hf"
    save_hf_model(folder, "llama")
    hf = read_hf_model(folder)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (3, 7), generator=g)  # (21 tokens: no activation has a weight's shape)
    models, escaped, dense_weights, losses = [], [], [], []
    for compiled in (False, True):
        module = hf.module_class(hf.job_class(model=hf.args, lora=LoRAConfig(rank=4, alpha=8.0, quantize_base="nf4")))
        with torch.device("meta"):
            module.model = module.build_model()
        module.materialize(torch.device("cpu"))
        model = module.model
        b = torch.Generator().manual_seed(1)  # (the same nonzero B in both models)
        with torch.no_grad():
            for _, layer in lora_layers(model):
                layer.lora_b.weight.copy_(0.1 * torch.randn(layer.lora_b.weight.shape, generator=b))
        blocks = list(model.layers.values())
        weights = {tuple(layer.weight.shape) for _, layer in lora_layers(model)}
        if checkpointing != "none":
            apply_activation_checkpointing(blocks, checkpointing)
        if compiled:
            compile_blocks(blocks)
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            x = model.tok_embeddings(tokens).detach().requires_grad_()
            for block in blocks[:1]:
                block(x, model.rope_cache)
        inputs = {x.data_ptr(), model.rope_cache.data_ptr()}
        # (torch 2.11's checkpoint also saves an empty tensor: no memory)
        escaped.append(sorted(tuple(t.shape) for t in packed if t.data_ptr() not in inputs and t.numel()))
        dense_weights.append([tuple(t.shape) for t in packed if tuple(t.shape) in weights and not is_nf4(t)])
        losses.append(_cross_entropy(model(tokens), tokens))
        losses[-1].backward()
        models.append(model)
    assert dense_weights == [[], []], dense_weights
    if checkpointing == "full":
        assert escaped == [[], []], escaped  # (the checkpoint's inputs alone)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    eager, compiled = (dict(lora_layers(m)) for m in models)
    for name, layer in eager.items():
        torch.testing.assert_close(compiled[name].lora_a.weight.grad, layer.lora_a.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled[name].lora_b.weight.grad, layer.lora_b.weight.grad, rtol=1e-5, atol=1e-6)


def _graph_linears(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Each compiled block's count of linear calls (its captured graph, no inductor), and the loss."""
    counts = []

    def backend(gm, example_inputs):
        counts.append(sum(n.target in (torch._C._nn.linear, torch.nn.functional.linear) for n in gm.graph.nodes))
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=True)
    return counts, _cross_entropy(model(tokens), tokens)


def test_compiled_blocks_compute_the_adapters_of_one_input_in_one_gemm(tmp_path):
    """Under compile a block's q / k / v and its gate / up compute their adapters' As as one GEMM
    (``LoRALinear.together``): 4 A GEMMs a block instead of 7, same loss and gradients as eager (which
    computes op for op as PEFT does). A layer whose call carries a hook (a tensor-parallel style's)
    keeps its own call."""
    from titan_lightning.pretrained import read_hf_model

    folder = tmp_path / "hf"
    save_hf_model(folder, "llama")
    hf = read_hf_model(folder)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))

    def model():
        module = hf.module_class(hf.job_class(model=hf.args, lora=LoRAConfig(rank=4, alpha=8.0)))
        with torch.device("meta"):
            module.model = module.build_model()
        module.materialize(torch.device("cpu"))
        b = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _, layer in lora_layers(module.model):
                layer.lora_b.weight.copy_(0.1 * torch.randn(layer.lora_b.weight.shape, generator=b))
        return module.model

    eager = model()
    _cross_entropy(eager(tokens), tokens).backward()
    compiled = model()
    counts, loss = _graph_linears(compiled, tokens)
    loss.backward()
    assert counts == [7 + 4 + 7] * len(counts)  # (bases, As, Bs)
    torch.testing.assert_close(loss, _cross_entropy(eager(tokens), tokens), rtol=1e-6, atol=0)
    theirs = dict(lora_layers(eager))
    for name, layer in lora_layers(compiled):
        torch.testing.assert_close(layer.lora_a.weight.grad, theirs[name].lora_a.weight.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(layer.lora_b.weight.grad, theirs[name].lora_b.weight.grad, rtol=1e-5, atol=1e-7)
    hooked = model()
    for block in hooked.layers.values():
        block.attention.wq.register_forward_pre_hook(lambda module, args: None)
    counts, _ = _graph_linears(hooked, tokens)
    assert counts == [7 + 5 + 7] * len(counts)  # (q's A on its own; k / v still joint)
