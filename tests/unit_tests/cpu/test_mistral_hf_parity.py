"""A Hugging Face Mistral / Mixtral folder (tiny, random fp32 weights; Mistral with head_dim !=
dim / n_heads as Nemo), read through config.json and our adapter, gives the logits transformers
computes from it, with and without a sliding window shorter than the tokens, and its export loads in
transformers with our logits (the export of each family: test_export_hf_parity.py)."""

import dataclasses
import json

import pytest
import torch

from titan_lightning.config import ConfigError
from titan_lightning.models.mistral import MistralStateDictAdapter
from titan_lightning.pretrained import read_hf_model

from tests.hf_folders import VOCAB, assert_transformers_agrees, export_hf, load_ours, save_hf_model

TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("model_type, tie", [("mistral", False), ("mistral", True), ("mixtral", False)],
                         ids=["mistral-untied", "mistral-tied", "mixtral"])
def test_logits_match_transformers(tmp_path, model_type, tie):
    pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")
    reference = save_hf_model(tmp_path, model_type, tie=tie)
    with torch.no_grad():
        expected = reference(input_ids=TOKENS).logits
        assert expected.std() > 0.5
        torch.testing.assert_close(load_ours(tmp_path)(TOKENS), expected, rtol=1e-5, atol=1e-5)


def _config(tmp_path, model_type="mistral", **fields):
    config = {"model_type": model_type, "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "rope_theta": 1e6, "sliding_window": None,
              "hidden_act": "silu", "attention_dropout": 0.0, **fields}
    if model_type == "mixtral":
        config.update(num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02, router_jitter_noise=0.0)
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    return tmp_path


def test_head_dim_and_the_mixtral_router_read_from_config_json(tmp_path):
    assert read_hf_model(_config(tmp_path)).args.head_dim == 32
    assert read_hf_model(_config(tmp_path, head_dim=None)).args.head_dim == 16  # Mixtral's null: dim / n_heads
    assert read_hf_model(_config(tmp_path, sliding_window=64)).args.moe is None  # a window over every position
    moe = read_hf_model(_config(tmp_path, "mixtral")).args.moe
    assert (moe.num_experts, moe.top_k, moe.hidden_dim, moe.route_norm, moe.load_balance_coeff) == (8, 2, 96, True, None)


@pytest.mark.parametrize("model_type", ["mistral", "mixtral"])
def test_a_sliding_window_reads_exports_and_matches_transformers(tmp_path, model_type):
    """Mistral 7B v0.1's kind of config: one window (here 6 tokens of 24) on every layer."""
    pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")
    reference = save_hf_model(tmp_path / "hf", model_type, sliding_window=6)
    ours = load_ours(tmp_path / "hf")
    assert (ours.args.sliding_window, ours.args.layer_types) == (6, None)
    with torch.no_grad():
        expected = reference(input_ids=TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), expected, rtol=1e-5, atol=1e-5)
        full = type(ours)(dataclasses.replace(ours.args, sliding_window=None))  # the same weights, no window
        full.load_state_dict(ours.state_dict())
        assert (full.eval()(TOKENS) - expected).abs().max() > 1e-2
    export = export_hf(ours, MistralStateDictAdapter, tmp_path / "export")
    theirs = assert_transformers_agrees(export, ours, TOKENS, rtol=1e-5, atol=1e-5)
    assert theirs.config.sliding_window == 6


@pytest.mark.parametrize("model_type, fields, message", [
    ("mistral", {"rope_scaling": {"type": "yarn", "factor": 4.0}}, "RoPE scaling"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
])
def test_what_mistral_does_not_model_is_refused_by_name(tmp_path, model_type, fields, message):
    with pytest.raises(ConfigError, match=message):
        read_hf_model(_config(tmp_path, model_type, **fields))


def test_a_mistral_config_without_sliding_window_has_transformers_default_window(tmp_path):
    """transformers' MistralConfig defaults to a 4096-token window: absent is not null."""
    config = json.loads(_config(tmp_path).joinpath("config.json").read_text())
    del config["sliding_window"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    assert read_hf_model(tmp_path).args.sliding_window == 4096


# Published (total, active) parameters: Mistral 7B 7.3B, Nemo 12.2B (Hub), Mixtral 8x7B 46.7B / 12.9B,
# 8x22B 141B / 39B (Mistral's announcements).
PUBLISHED = {"7B": (7.3e9, 7.3e9), "Nemo-12B": (12.2e9, 12.2e9), "8x7B": (46.7e9, 12.9e9), "8x22B": (141e9, 39e9)}


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_presets_have_the_published_parameter_counts(flavor):
    from titan_lightning.models.mistral import Transformer, mistral_args

    args = mistral_args(flavor)
    counts = Transformer.count_parameters(args), Transformer.count_parameters(args, active=True)
    assert counts == pytest.approx(PUBLISHED[flavor], rel=0.01)


_COMMON = {"architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
           "hidden_act": "silu", "initializer_range": 0.02, "intermediate_size": 14336, "model_type": "mistral",
           "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True}
# Mistral-7B-v0.3's, Mistral-Nemo-Base-2407's and Mixtral-8x7B-v0.1's config.json as published.
RELEASED = {
    "7B": {**_COMMON, "hidden_size": 4096, "max_position_embeddings": 32768, "num_attention_heads": 32,
           "num_hidden_layers": 32, "vocab_size": 32768, "transformers_version": "4.42.0.dev0"},
    "Nemo-12B": {**_COMMON, "head_dim": 128, "hidden_size": 5120, "max_position_embeddings": 128000,
                 "num_attention_heads": 32, "num_hidden_layers": 40, "vocab_size": 131072,
                 "transformers_version": "4.43.3"},
    "8x7B": {**_COMMON, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
             "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32, "vocab_size": 32000,
             "num_experts_per_tok": 2, "num_local_experts": 8, "output_router_logits": False,
             "router_aux_loss_coef": 0.02, "transformers_version": "4.36.0.dev0"},
}


@pytest.mark.parametrize("flavor", RELEASED)
def test_a_released_config_json_reads_as_its_preset(tmp_path, flavor):
    import dataclasses

    from titan_lightning.models.mistral import mistral_args
    from titan_lightning.pretrained import check_folder_matches

    (tmp_path / "config.json").write_text(json.dumps(RELEASED[flavor]))
    preset = mistral_args(flavor)
    if preset.moe is not None:  # from a folder: no routing bias (Mixtral's checkpoint has none)
        preset.moe = dataclasses.replace(preset.moe, load_balance_coeff=None)
    assert read_hf_model(tmp_path).args == preset
    check_folder_matches(mistral_args(flavor), MistralStateDictAdapter, tmp_path)
