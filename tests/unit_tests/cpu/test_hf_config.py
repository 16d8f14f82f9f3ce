"""config.json <-> our model args: what transformers saves reads back as the model it describes,
exports describe what we trained, and every field is mapped, checked or refused by name."""

import dataclasses
import json

import pytest
import torch

from titan_lightning.config import ConfigError, validate_job
from titan_lightning.data.tokenizer import load_tokenizer
from titan_lightning.models.common.decoder import decoder_class
from titan_lightning.models.common.hf_config import HFConfig
from titan_lightning.models.gemma3 import GEMMA3_PRESETS, Gemma3StateDictAdapter
from titan_lightning.models.llama3 import LLAMA3_PRESETS, Llama3StateDictAdapter
from titan_lightning.models.mistral import MISTRAL_PRESETS, MistralStateDictAdapter
from titan_lightning.models.olmo2 import OLMO2_PRESETS, Olmo2StateDictAdapter
from titan_lightning.models.phi3 import PHI3_PRESETS, LongRope, Phi3StateDictAdapter
from titan_lightning.models.qwen2 import QWEN2_PRESETS, Qwen2StateDictAdapter
from titan_lightning.models.qwen3 import QWEN3_PRESETS, Qwen3Module, Qwen3StateDictAdapter
from titan_lightning.pretrained import check_folder_matches, read_hf_model

from tests.hf_folders import hf_config, save_hf_folder

transformers = pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")


def _saved_config(tmp_path, model_type, **overrides) -> dict:
    hf_config(model_type, **overrides).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe"])
def test_a_transformers_folder_gives_the_model_transformers_computes(tmp_path, model_type):
    folder = save_hf_folder(tmp_path / "hf", model_type, tie=model_type == "llama")
    model = read_hf_model(folder)
    assert model.tie_word_embeddings == (model_type == "llama")
    ours = decoder_class(type(model.args))(model.args)
    model.module_class.hf_adapter(model.args, tie_word_embeddings=model.tie_word_embeddings).load_into(ours, folder)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("adapter, args", [
    *[(Llama3StateDictAdapter, LLAMA3_PRESETS[name]) for name in ("debugmodel", "1B", "8B")],
    *[(Qwen3StateDictAdapter, QWEN3_PRESETS[name]) for name in ("debugmodel", "0.6B", "30B-A3B")],
    *[(Qwen2StateDictAdapter, QWEN2_PRESETS[name]) for name in ("0.5B", "72B")],
    *[(MistralStateDictAdapter, MISTRAL_PRESETS[name]) for name in ("Nemo-12B", "8x7B")],
    *[(Gemma3StateDictAdapter, GEMMA3_PRESETS[name]) for name in ("debugmodel", "1B", "27B")],
    *[(Phi3StateDictAdapter, PHI3_PRESETS[name]) for name in ("mini-4k", "phi-4")],
    (Phi3StateDictAdapter, dataclasses.replace(PHI3_PRESETS["phi-4-mini"], max_seq_len=131072, rope_scaling=LongRope(
        short_factor=[1.0] * 48, long_factor=[2.0] * 48, attention_factor=1.19))),
    *[(Olmo2StateDictAdapter, OLMO2_PRESETS[name]) for name in ("1B", "32B")],
], ids=["llama3-debugmodel", "llama3-1B", "llama3-8B", "qwen3-debugmodel", "qwen3-0.6B", "qwen3-30B-A3B",
        "qwen2-0.5B", "qwen2-72B", "mistral-Nemo-12B", "mixtral-8x7B", "gemma3-debugmodel", "gemma3-1B", "gemma3-27B",
        "phi3-mini-4k", "phi3-phi-4", "phi3-phi-4-mini-longrope",
        "olmo2-1B", "olmo2-32B"])
def test_written_config_reads_back_as_the_same_model_and_transformers_takes_it(adapter, args):
    written = adapter.hf_config(args)
    reader = HFConfig({**written, "torch_dtype": "float32"}, "config.json", adapter.family)
    back = adapter.args_from_hf_config(reader)
    reader.finish()
    assert adapter.hf_config(back) == written
    if getattr(args, "moe", None) is not None:  # Hugging Face's MoE has no routing bias
        assert back.moe == dataclasses.replace(args.moe, load_balance_coeff=None)
    config = transformers.AutoConfig.for_model(**written)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (args.dim, args.n_layers, args.vocab_size)


def test_llama_rope_scaling_and_intermediate_size_come_from_the_config(tmp_path):
    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = _saved_config(tmp_path, "llama", rope_parameters=scaling, intermediate_size=96)
    args = Llama3StateDictAdapter.args_from_hf_config(HFConfig(config, "c", "Llama"))
    assert args.ffn_hidden_dim == 96 and args.rope_theta == 500000.0
    assert (args.rope_scaling.factor, args.rope_scaling.original_max_position_embeddings) == (32.0, 8192)
    # transformers 4's spelling: rope_theta and rope_scaling with "type".
    old = {**{k: v for k, v in config.items() if k != "rope_parameters"}, "rope_theta": 500000.0,
           "rope_scaling": {"type": "llama3", **{k: v for k, v in scaling.items() if k not in ("rope_type", "rope_theta")}}}
    assert Llama3StateDictAdapter.args_from_hf_config(HFConfig(old, "c", "Llama")) == args


@pytest.mark.parametrize("model_type, change, message", [
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     'rope_type="yarn" is not supported here'),
    ("llama", {"head_dim": 32}, "head_dim=32 is not supported by Llama here (supported: 16 or null)"),
    ("llama", {"hidden_act": "gelu"}, 'hidden_act="gelu" is not supported by Llama here (supported: "silu")'),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window=true is not supported by Qwen3"),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types="),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1] is not supported by Qwen3"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
    ("qwen3", {"some_new_field": 3}, "some_new_field=3 not modelled by Qwen3 here"),
])
def test_fields_we_do_not_implement_are_refused_by_name(tmp_path, model_type, change, message):
    config = {**_saved_config(tmp_path, model_type), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="^" + str(tmp_path / "config.json").replace("+", r"\+") + ".*" +
                       message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        read_hf_model(tmp_path)


def test_a_missing_field_is_named(tmp_path):
    config = _saved_config(tmp_path, "qwen3")
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config.json: hidden_size is missing; Qwen3 needs it"):
        read_hf_model(tmp_path)


def test_a_preset_that_differs_from_the_folder_is_one_line_with_both_values(tmp_path):
    _saved_config(tmp_path, "qwen3")
    args = dataclasses.replace(read_hf_model(tmp_path).args, norm_eps=1e-5)
    with pytest.raises(ConfigError, match=r"rms_norm_eps is 1e-05 here, 1e-06 there"):
        check_folder_matches(args, Qwen3StateDictAdapter, tmp_path)
    check_folder_matches(read_hf_model(tmp_path).args, Qwen3StateDictAdapter, tmp_path)
    with pytest.raises(ConfigError, match=r"holds a Qwen3 model; this run builds Llama"):
        check_folder_matches(LLAMA3_PRESETS["debugmodel"], Llama3StateDictAdapter, tmp_path)


def test_an_export_of_a_trained_routing_bias_is_refused(tmp_path):
    # The family's own rule, run by the one validation entry (Qwen3Job.check_family).
    module = Qwen3Module(__import__("recipes.qwen3", fromlist=["x"]).debugmodel_moe().job)
    job = module.job

    def exporting(fmt: str):
        return dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, export_format=fmt))

    with pytest.raises(ConfigError, match="has no routing bias, and model.moe.load_balance_coeff=0.001 trains one"):
        validate_job(exporting("hf"), world_size=1)
    validate_job(exporting("dcp"), world_size=1)
    adapter = module.state_dict_adapter()
    model = decoder_class(type(module.job.model))(module.job.model)
    state = model.state_dict()
    state["layers.0.moe.expert_bias"] = torch.ones_like(state["layers.0.moe.expert_bias"])
    with pytest.raises(ValueError, match="layers.0.moe.expert_bias is not zero"):
        adapter.to_hf(state)


@pytest.mark.parametrize("model_type, eos, bos", [("llama", "<|end_of_text|>", "<|begin_of_text|>"),
                                                  ("qwen3", "<|endoftext|>", None)])
def test_the_folder_tokenizer_ends_documents_with_its_eos_token(tmp_path, model_type, eos, bos):
    from tests.hf_folders import train_tokenizer

    train_tokenizer(tmp_path, model_type)
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.eot_token == eos and tokenizer.bos_token == bos
    assert tokenizer.eot_id == tokenizer._tokenizer.token_to_id(eos)
    assert (tokenizer.bos_id is None) == (bos is None)


def test_a_fit_from_a_folder_reads_its_config_json_once(tmp_path, monkeypatch):
    """recipes.hf:pretrained parses the folder's config.json once per launch: what the recipe read
    travels on the module to the one pre-launch check and to the load, which ties the output to the
    embeddings as the folder says (the folder holds no lm_head.weight: an untied load would fail)."""
    import shutil

    from titan_lightning import cli
    from titan_lightning.data.tokenizer import tokenizer_file
    from titan_lightning.models.common import hf_config as hf_config_module
    from titan_lightning.models.common.safetensors_io import save_hf_safetensors

    folder = tmp_path / "hf"
    folder.mkdir()
    config = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 160,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 64, "rope_theta": 500000.0, "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(config))
    hf = read_hf_model(folder)
    model = decoder_class(type(hf.args))(hf.args)
    model.init_weights(seed=0)
    state = model.state_dict()
    state["output.weight"] = state["tok_embeddings.weight"]
    save_hf_safetensors(hf.adapter().to_hf(state), folder)
    shutil.copyfile(tokenizer_file(None), folder / "tokenizer.json")
    parsed = []
    read_json_object = hf_config_module.read_json_object
    monkeypatch.setattr(hf_config_module, "read_json_object",
                        lambda path: parsed.append(path) or read_json_object(path))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["fit", "--recipe", "recipes.hf:pretrained", "--job.checkpoint.initial_load_path", str(folder),
                     "--trainer.max_steps", "1", "--trainer.accelerator", "cpu", "--trainer.limit_val_batches", "0",
                     "--trainer.enable_progress_bar", "false"]) == 0
    assert [path for path in parsed if path.name == "config.json"] == [folder / "config.json"]


def test_every_family_folder_is_listed_once_and_found_by_its_model_types():
    """models/registry.py lists every package under models/ with a module.py; a config.json's
    model_type finds the family whose adapter reads it."""
    from pathlib import Path

    import titan_lightning.models
    from titan_lightning.models.registry import FAMILIES, family, hf_families

    packages = {path.parent.name for path in Path(titan_lightning.models.__file__).parent.glob("*/module.py")}
    assert packages == set(FAMILIES)
    found = hf_families()
    for package in FAMILIES:
        job_class, module_class = family(package)
        assert job_class.__dataclass_fields__["model"].type is module_class.hf_adapter.args_class
        assert all(found[t] == (job_class, module_class) for t in module_class.hf_adapter.hf_model_types)
