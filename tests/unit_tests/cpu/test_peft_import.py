"""Adapters made elsewhere (titan_lightning/lora/peft_import.py): a PEFT adapter folder, as PEFT's
``save_pretrained`` writes it, tried with ``generate`` / ``chat`` on our model of its base computes
PeftModel's logits (fp32, CPU; rsLoRA, a list, a regex, all-linear, a router's weight and the routed
experts' tensors as targets); our export read back is the identity; PEFT's keys with the adapter name
and its older adapter_model.bin load; the base comes from adapter_config.json or --base, the tokenizer
and generation settings from the adapter folder when it has them; whatever LoRA here does not compute
is refused in one line."""

import io
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_lightning import cli
from titan_lightning.config import ConfigError
from titan_lightning.config.lora import LoRAConfig
from titan_lightning.generate import GenerateError, find_model
from titan_lightning.lora.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_state, write_peft_folder
from titan_lightning.trainer import RUN_DIR_ENV

from tests.hf_folders import VOCAB, save_hf_folder, save_hf_model

transformers = pytest.importorskip("transformers", reason="the reference implementation; not a project dependency")
peft = pytest.importorskip("peft", reason="PEFT writes the adapter folders read here (setup.cfg's dev extra)")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def peft_folder(base_folder: Path, model_type: str, out: Path, tie: bool = False, **lora) -> torch.nn.Module:
    """A random model of ``model_type`` saved in ``base_folder``, and a PEFT adapter on it saved by PEFT in
    ``out`` (``peft_folder_on``); the PeftModel, in eval mode."""
    base = save_hf_model(base_folder, model_type, tie=tie)
    base.name_or_path = str(base_folder)  # (as from_pretrained(base_folder) records it)
    return peft_folder_on(base, out, **lora)


def peft_folder_on(base: torch.nn.Module, out: Path, **lora) -> torch.nn.Module:
    """A PEFT adapter on ``base`` (B off zero, so every adapter changes the output) saved by PEFT in ``out``,
    naming its base; the PeftModel, in eval mode."""
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, **lora))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return model.eval()


def our_logits(found, tokens: torch.Tensor) -> torch.Tensor:
    model = found.load(torch.device("cpu"), torch.float32)
    with torch.no_grad():
        return model.output(model(tokens))


def assert_peft_agrees(adapter: Path, theirs: torch.nn.Module, **find) -> None:
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = theirs(input_ids=tokens).logits
        with theirs.disable_adapter():
            assert (logits - theirs(input_ids=tokens).logits).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(our_logits(find_model(str(adapter), **find), tokens), logits, rtol=1e-5, atol=1e-5)


# Dense with rsLoRA on all linear layers; tied embeddings with a list of names; Gemma 3's sliding and
# global layers with a regex; Phi-3's fused qkv_proj and gate_up_proj; Gemma 3's multimodal model; an MoE model's
# router weight (target_parameters gate.weight, as PEFT rewrites target_modules "gate"; gpt-oss's router, no
# nn.Linear in transformers) and its routed experts (both fused tensors).
CASES = [("llama", False, dict(target_modules="all-linear", use_rslora=True)),
         ("qwen3", True, dict(target_modules=["q_proj", "k_proj", "down_proj"])),
         ("gemma3_text", False, dict(target_modules=r".*\.(q_proj|k_proj|o_proj|up_proj)")),
         ("qwen3_moe", False, dict(target_modules=["q_proj", "v_proj", "gate"], target_parameters=EXPERTS)),
         ("phi3", False, dict(target_modules=["qkv_proj", "gate_up_proj"])),  # (fused linears: one A, B split)
         ("gemma3", False, dict(target_modules="all-linear")),  # (multimodal: the vision tower's adapters left out)
         ("gpt_oss", False, dict(target_modules="all-linear", target_parameters=["mlp.router.weight"]))]


@pytest.mark.parametrize("model_type,tie,lora", CASES, ids=[c[0] for c in CASES])
def test_generate_on_a_peft_folder_computes_peft_logits(model_type, tie, lora, tmp_path):
    theirs = peft_folder(tmp_path / "base", model_type, tmp_path / "adapter", tie=tie, **lora)
    assert_peft_agrees(tmp_path / "adapter", theirs)


@pytest.mark.parametrize("form", ["adapter name in the keys", "adapter_model.bin"])
def test_other_saved_forms_load(form, tmp_path):
    theirs = peft_folder(tmp_path / "base", "qwen3", tmp_path / "adapter", target_modules=["q_proj", "o_proj"])
    file = tmp_path / "adapter" / ADAPTER_WEIGHTS
    state = load_file(file)
    if form == "adapter_model.bin":  # (PEFT's file before safetensors)
        file.unlink()
        torch.save(state, tmp_path / "adapter" / "adapter_model.bin")
    else:  # (as some tools save them: lora_A.default.weight)
        save_file({k.replace(".weight", ".default.weight"): v for k, v in state.items()}, str(file))
        assert all(".default.weight" in k for k in load_file(file))
    assert_peft_agrees(tmp_path / "adapter", theirs)


@pytest.mark.parametrize("model_type,lora", [
    ("llama", LoRAConfig(rank=4, alpha=8.0)),
    ("qwen3_moe", LoRAConfig(rank=2, alpha=3.0, target_modules="q_proj,k_proj,gate",
                             target_parameters="gate_up_proj,down_proj")),
    ("phi3", LoRAConfig(rank=4, alpha=8.0)),
    ("gemma3", LoRAConfig(rank=4, alpha=8.0)),  # (named as in the multimodal model, its language model's targets)
    ("gpt_oss", LoRAConfig(rank=4, alpha=8.0)),  # (all-linear: PEFT's, without the router)
    ("gpt_oss", LoRAConfig(rank=4, alpha=8.0, target_modules="q_proj,router")),  # (target_parameters router.weight)
])
def test_our_export_read_back_is_the_identity_and_peft_loads_it(model_type, lora, tmp_path):
    from test_lora import _ours

    base = save_hf_model(tmp_path / "base", model_type).eval()
    model, adapter = _ours(tmp_path / "base", lora)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_b" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    write_peft_folder(tmp_path / "adapter", peft_state(model, adapter), lora, str(tmp_path / "base"), adapter)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()  # (PEFT on the transformers model)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), theirs(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
    found = find_model(str(tmp_path / "adapter"))
    assert replace(found.lora, target_modules=sorted(found.lora.target_modules)) == \
        replace(lora, target_modules=sorted(lora.target_modules))
    ours = {name: p for name, p in model.named_parameters() if ".lora_" in name}
    assert found.peft.keys() == ours.keys()
    assert all(torch.equal(found.peft[name], p) for name, p in ours.items())


def test_base_tokenizer_and_generation_settings(tmp_path, monkeypatch, capsys):
    """The base: adapter_config.json's when a local folder, else --base; neither: one line naming both.
    The tokenizer and generation_config.json: the adapter folder's when it has them, else the base's."""
    base = save_hf_folder(tmp_path / "base", "llama")
    theirs = peft_folder(base, "llama", tmp_path / "adapter", target_modules=["v_proj"])
    (base / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    found = find_model(str(tmp_path / "adapter"))
    assert (found.base_folder, found.tokenizer_path, found.settings_folder) == (base, str(base), base)

    moved = tmp_path / "moved"  # the base somewhere else than the adapter recorded
    shutil.move(str(base), moved)
    with pytest.raises(GenerateError) as error:
        find_model(str(tmp_path / "adapter"))
    assert f"base_model_name_or_path={str(base)!r}" in str(error.value) and "--base" in str(error.value)
    with pytest.raises(GenerateError, match="--base='/nowhere' holds no config.json"):
        find_model(str(tmp_path / "adapter"), base="/nowhere")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(moved / name, tmp_path / "adapter" / name)
    (tmp_path / "adapter" / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    found = find_model(str(tmp_path / "adapter"), base=str(moved))
    adapter = tmp_path / "adapter"
    assert (found.base_folder, found.tokenizer_path, found.settings_folder) == (moved, str(adapter), adapter)

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code = cli.main(["generate", "--model", str(adapter), "--base", str(moved), "--prompt", "Once", "--greedy"])
    out, err = capsys.readouterr()
    ids = found.tokenizer.encode("Once")
    ids = ([found.tokenizer.bos_id] if found.tokenizer.add_bos else []) + ids
    with torch.no_grad():
        for _ in range(3):  # generation_config.json's max_new_tokens, PeftModel's greedy picks
            ids.append(int(theirs(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    expected = found.tokenizer.decode([i for i in ids[-3:] if i != found.tokenizer.eot_id])
    assert (code, out) == (0, expected + "\n") and "3 tokens" in err


@pytest.fixture(scope="module")
def made_by_peft(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("peft")
    peft_folder(root / "base", "llama", root / "adapter", target_modules=["q_proj", "v_proj"])
    return root


# (a change to adapter_config.json, or to the weights file; what the one-line error says)
REFUSALS = [
    ({"peft_type": "LOHA"}, 'peft_type="LOHA"'),
    ({"use_dora": True}, "use_dora=true"),
    ({"bias": "lora_only"}, 'bias="lora_only"'),
    ({"modules_to_save": ["lm_head"]}, 'modules_to_save=["lm_head"]'),
    ({"layers_to_transform": [0]}, "layers_to_transform=[0]"),
    ({"layers_pattern": "layers"}, 'layers_pattern="layers"'),
    ({"rank_pattern": {"q_proj": 8}}, 'rank_pattern={"q_proj": 8}'),
    ({"alpha_pattern": {"q_proj": 32}}, 'alpha_pattern={"q_proj": 32}'),
    ({"fan_in_fan_out": True}, "fan_in_fan_out=true"),
    ({"lora_bias": True}, "lora_bias=true"),
    ({"some_new_field": 3}, "some_new_field=3"),
    ({"r": 0}, "r=0"),
    ({"target_modules": r"model\.layers\.0\.self_attn\.q_proj"}, "adapts model.layers.0.self_attn.q_proj but not "
                                                                  "model.layers.1.self_attn.q_proj"),
    ({"target_modules": ["lm_head"]}, "adapts none of Llama's linears;"),
    ("unmatched", "base_model.model.lm_head.lora_A.weight (1 such keys) has no place"),
    ("missing", "no base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight (1 missing)"),
    ("bad shape", "q_proj.lora_A.weight has shape [8, 64], not the adapter of layers.0.attention.wq.lora_a.weight "
                  "[4, 64]; valid: r=4"),
]


@pytest.mark.parametrize("change,says", REFUSALS, ids=[str(c[0]) for c in REFUSALS])
def test_what_lora_here_does_not_compute_is_refused_in_one_line(made_by_peft, tmp_path, change, says):
    adapter = tmp_path / "adapter"
    shutil.copytree(made_by_peft / "adapter", adapter)
    config, state = json.loads((adapter / ADAPTER_CONFIG).read_text()), load_file(adapter / ADAPTER_WEIGHTS)
    prefix = "base_model.model.model."
    if change == "unmatched":
        state["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    elif change == "missing":
        del state[f"{prefix}layers.1.self_attn.v_proj.lora_B.weight"]
    elif change == "bad shape":
        state[f"{prefix}layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(8, 64)
    else:
        config.update(change)
    (adapter / ADAPTER_CONFIG).write_text(json.dumps(config))
    save_file(state, str(adapter / ADAPTER_WEIGHTS))
    with pytest.raises(ConfigError) as error:
        find_model(str(adapter))
    message = str(error.value)
    assert says in message and "\n" not in message and "valid:" in message, message


def test_experts_adapted_in_some_layers_only_are_refused_in_one_line(tmp_path):
    """OpenAI's gpt-oss recipe names the experts of chosen layers (``7.mlp.experts.gate_up_proj``);
    job.lora adapts every MoE layer's, so such a folder is refused naming the entry."""
    peft_folder(tmp_path / "base", "gpt_oss", tmp_path / "adapter", target_modules="all-linear",
                target_parameters=["1.mlp.experts.gate_up_proj", "1.mlp.experts.down_proj"])
    with pytest.raises(ConfigError, match=r"target_parameters entry '1.mlp.experts.gate_up_proj' reaches the routed "
                                          r"experts of 1 of the 2 MoE layers; .* valid: 'gate_up_proj'"):
        find_model(str(tmp_path / "adapter"))


def test_a_run_starts_its_adapters_from_a_peft_folder(tmp_path, monkeypatch, capsys):
    """``--job.lora.init_from``: the fresh run's adapters are the folder's (its step 1 computes PeftModel's
    logits, so its loss is PeftModel's: a step of lr 1e-30 leaves them as they were, and the merged export
    computes them); adapters other than the job's are refused before launch with the options that fit."""
    from tests.hf_folders import folder_and_conversations

    folder, data = folder_and_conversations(tmp_path, "qwen3")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = peft_folder_on(base, tmp_path / "adapter", target_modules=["q_proj", "v_proj"])
    run = ["fit", "--recipe", "recipes.hf:lora", "--job.checkpoint.initial_load_path", str(folder),
           "--job.data.dataset_path", str(data), "--trainer.accelerator", "cpu", "--trainer.max_steps", "1",
           "--trainer.enable_progress_bar", "false", "--job.data.val_fraction", "0",
           "--job.training.tokens_per_step", "128", "--job.training.tokens_per_microbatch_per_dp_rank", "128",
           "--job.lora.init_from", str(tmp_path / "adapter"), "--job.lora.rank", "4", "--job.lora.alpha", "8"]
    capsys.readouterr()
    assert cli.main(run) == 2  # (the recipe's targets: all-linear)
    err = capsys.readouterr().err
    assert "--job.lora.target_modules q_proj,v_proj" in err and len(err.splitlines()) == 1, err

    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    assert cli.main([*run, "--job.lora.target_modules", "v_proj,q_proj", "--job.optimizer.lr", "1e-30"]) == 0
    export = tmp_path / "run" / "export_hf"
    started = load_file(export / "adapter" / ADAPTER_WEIGHTS)
    assert started.keys() == load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS).keys()
    assert all(torch.equal(t, load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)[k]) for k, t in started.items())
    tokens = torch.randint(0, VOCAB, (2, 12))
    merged = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=tokens).logits, theirs(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)


def test_a_resumed_run_never_reads_the_folder_its_adapters_started_from(tmp_path, monkeypatch, capsys):
    """The folder ``lora.init_from`` named may be gone when the run resumes (another machine, a cleaned
    scratch disk): the checkpoint holds the adapters. A fresh run without it is refused before launch."""
    from tests.hf_folders import folder_and_conversations

    folder, data = folder_and_conversations(tmp_path, "qwen3")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft_folder_on(base, tmp_path / "adapter", target_modules=["q_proj", "v_proj"])
    run = ["fit", "--recipe", "recipes.hf:lora", "--job.checkpoint.initial_load_path", str(folder),
           "--job.data.dataset_path", str(data), "--trainer.accelerator", "cpu", "--trainer.max_steps", "1",
           "--trainer.enable_progress_bar", "false", "--job.data.val_fraction", "0", "--job.checkpoint.interval", "1",
           "--job.training.tokens_per_step", "128", "--job.training.tokens_per_microbatch_per_dp_rank", "128",
           "--job.lora.init_from", str(tmp_path / "adapter"), "--job.lora.rank", "4", "--job.lora.alpha", "8",
           "--job.lora.target_modules", "q_proj,v_proj"]
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    assert cli.main(run) == 0
    (checkpoint,) = (tmp_path / "run" / "checkpoints").glob("*step=1*")
    shutil.rmtree(tmp_path / "adapter")
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "resumed"))
    assert cli.main([*run, "--trainer.max_steps", "2", "--job.checkpoint.resume_from", str(checkpoint)]) == 0
    capsys.readouterr()
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "fresh"))
    assert cli.main(run) == 2
    err = capsys.readouterr().err
    assert f"lora.init_from={str(tmp_path / 'adapter')!r} holds no adapter_config.json" in err, err
    assert len(err.strip().splitlines()) == 1, err
