"""A Hugging Face Gemma 3 text folder (tiny, random fp32 weights: a sliding and a global layer, each
with its RoPE base, the global one linearly scaled; queries scaled by query_pre_attn_scalar), read
through config.json and our adapter, gives the logits transformers computes from it (tied and
untied, with and without a final soft cap); a multimodal gemma3 folder reads as its text model and
exports as one (the export of each family: test_export_hf_parity.py); what Gemma 3 does not model is refused by name."""

import dataclasses
import json

import pytest
import torch

from titan_lightning.config import ConfigError
from titan_lightning.models.gemma3 import Gemma3StateDictAdapter
from titan_lightning.pretrained import read_hf_model

from tests.hf_folders import VOCAB, export_hf, load_in_transformers, load_ours, save_hf_model

TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tie, softcap", [(True, None), (False, 2.0)], ids=["tied", "untied-softcapped"])
def test_logits_match_transformers(tmp_path, tie, softcap):
    pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")
    reference = save_hf_model(tmp_path, "gemma3_text", tie=tie, final_logit_softcapping=softcap)
    ours = load_ours(tmp_path)
    assert (ours.args.sliding_window, ours.args.layer_types) == (6, ["sliding_attention", "full_attention"])
    a = ours.args
    assert (a.rope_factor, a.query_pre_attn_scalar, a.final_logit_softcapping) == (8.0, 24, softcap)
    with torch.no_grad():
        expected = reference(input_ids=TOKENS).logits
        assert expected.std() > 0.5
        if softcap is not None:
            assert expected.abs().max() < softcap
        torch.testing.assert_close(ours(TOKENS), expected, rtol=1e-5, atol=1e-5)


def test_flex_attention_gives_the_same_logits(tmp_path):
    """FlexAttention (forward on CPU) takes the score scale and the sliding layer's block mask."""
    pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")
    reference = save_hf_model(tmp_path, "gemma3_text")
    ours = load_ours(tmp_path)
    flex = type(ours)(dataclasses.replace(ours.args, attention="flex"))
    flex.load_state_dict(ours.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(flex.eval()(TOKENS), reference(input_ids=TOKENS).logits, rtol=1e-5, atol=1e-5)


def test_the_chunked_loss_caps_the_logits_as_the_head_does():
    """The loss that applies the head chunk by chunk (training.loss_chunks) equals cross entropy of
    the soft-capped logits, and so do its gradients."""
    from titan_lightning.models.common.decoder import Head

    head = Head(16, 40, softcap=1.5)
    h = torch.randn(2, 6, 16, requires_grad=True)
    labels = torch.randint(0, 40, (2, 6))
    plain = torch.nn.functional.cross_entropy(head(h).flatten(0, 1), labels.flatten())
    grads = torch.autograd.grad(plain, (h, head.weight))
    chunked = head(h, labels=labels, chunks=3)
    torch.testing.assert_close(chunked, plain)
    for got, want in zip(torch.autograd.grad(chunked, (h, head.weight)), grads):
        torch.testing.assert_close(got, want)
    head.softcap = None
    assert (head(h, labels=labels, chunks=3) - plain).abs() > 1e-3


def _config(tmp_path, **fields):
    config = {**RELEASED_1B, "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, **fields}
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))
    return tmp_path


def test_layer_types_and_rope_read_as_transformers_reads_them(tmp_path):
    args = read_hf_model(_config(tmp_path, sliding_window_pattern=2)).args
    assert args.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (args.rope_theta, args.rope_factor, args.rope_local_theta) == (1e6, 1.0, 1e4)
    args = read_hf_model(_config(tmp_path, rope_scaling={"rope_type": "linear", "factor": 8.0})).args
    assert args.rope_factor == 8.0
    transformers_5 = {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 2e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 5e3}},
                      "rope_theta": ..., "rope_local_base_freq": ..., "rope_scaling": ...,
                      "layer_types": ["full_attention"] * 3, "sliding_window_pattern": ...}
    args = read_hf_model(_config(tmp_path, **transformers_5)).args
    assert (args.rope_theta, args.rope_factor, args.rope_local_theta, args.layer_types) == \
        (2e6, 4.0, 5e3, ["full_attention"] * 3)
    assert read_hf_model(_config(tmp_path, tie_word_embeddings=...)).tie_word_embeddings  # the family's default


@pytest.mark.parametrize("fields, message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
    ({"hidden_activation": "gelu"}, 'hidden_activation="gelu" is not supported'),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 'rope_scaling rope_type="yarn"'),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "scaled RoPE on the sliding layers"),
    ({"sliding_window": None}, "layer_types has sliding layers but sliding_window=null"),
    ({"layer_types": ["sliding_attention", "local", "full_attention"]}, "layer_types="),
    ({"vision_soft_tokens": 256}, "vision_soft_tokens=256 not modelled by Gemma3"),
])
def test_what_gemma3_does_not_model_is_refused_by_name(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        read_hf_model(_config(tmp_path, **fields))


def test_a_multimodal_folder_reads_as_its_text_model(tmp_path, capsys):
    """Gemma3ForConditionalGeneration (vision tower and projector beside the language model): ours
    is its language model, with its logits on text; the export is that text model, a gemma3_text
    folder transformers loads with our logits."""
    pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")
    reference = save_hf_model(tmp_path / "hf", "gemma3", tie=True)
    ours = load_ours(tmp_path / "hf")
    assert "the vision tower and projector are left out" in capsys.readouterr().out  # (the titan_lightning logger)
    assert (ours.args.layer_types, ours.args.rope_factor) == (["sliding_attention", "full_attention"], 8.0)
    with torch.no_grad():
        expected = reference(input_ids=TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), expected, rtol=1e-5, atol=1e-5)
    in_memory = reference.state_dict()  # transformers 5's own names: model.language_model.*, model.vision_tower.*
    assert any(k.startswith("model.language_model.") for k in in_memory)
    converted = Gemma3StateDictAdapter(ours.args, tie_word_embeddings=True).from_hf(in_memory)
    assert converted.keys() == ours.state_dict().keys()
    assert all(torch.equal(converted[k], v) for k, v in ours.state_dict().items())
    theirs = load_in_transformers(export_hf(ours, Gemma3StateDictAdapter, tmp_path / "export"))
    assert theirs.config.model_type == "gemma3_text"
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=TOKENS).logits, expected, rtol=1e-5, atol=1e-5)


# google/gemma-3-4b-pt's config.json: its text_config lists only what differs from Gemma3TextConfig's
# defaults (vision_config shortened: its fields are not read).
RELEASED_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "model_type": "siglip_vision_model"},
}


def test_the_released_4b_config_json_reads_as_its_preset(tmp_path):
    from titan_lightning.models.gemma3 import gemma3_args

    (tmp_path / "config.json").write_text(json.dumps(RELEASED_4B))
    model = read_hf_model(tmp_path)
    assert model.args == gemma3_args("4B") and model.tie_word_embeddings
    text = {**RELEASED_4B["text_config"], "attn_logit_softcapping": 30.0}
    (tmp_path / "config.json").write_text(json.dumps({**RELEASED_4B, "text_config": text}))
    with pytest.raises(ConfigError, match="config.json text_config: attn_logit_softcapping=30.0 is not supported"):
        read_hf_model(tmp_path)


# google/gemma-3-1b-pt's config.json as published (tied embeddings by default: no field).
RELEASED_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
}


def test_the_released_1b_config_json_reads_as_its_preset(tmp_path):
    from titan_lightning.models.gemma3 import gemma3_args
    from titan_lightning.pretrained import check_folder_matches

    (tmp_path / "config.json").write_text(json.dumps(RELEASED_1B))
    model = read_hf_model(tmp_path)
    assert model.args == gemma3_args("1B") and model.tie_word_embeddings
    check_folder_matches(gemma3_args("1B"), Gemma3StateDictAdapter, tmp_path)


# The model cards' parameter counts (tied: the embeddings once), text model only.
PUBLISHED = {"270M": 268_098_176, "1B": 999_885_952}


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_presets_have_the_model_cards_parameter_counts(flavor):
    from titan_lightning.models.gemma3 import Transformer, gemma3_args

    args = gemma3_args(flavor)
    assert Transformer.count_parameters(args) - args.vocab_size * args.dim == PUBLISHED[flavor]
