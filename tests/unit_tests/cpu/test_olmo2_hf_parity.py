"""A Hugging Face Olmo2 folder (tiny, random fp32 weights: post-norm blocks, QK-norm over whole
projections), read through config.json and our adapter, gives the logits transformers computes
from it, tied and untied (its export: test_export_hf_parity.py); what Olmo2 does not
model is refused by name; the published config.json files read as their presets."""

import json

import pytest
import torch

from titan_lightning.config import ConfigError
from titan_lightning.models.olmo2 import Olmo2StateDictAdapter
from titan_lightning.pretrained import read_hf_model

from tests.hf_folders import VOCAB, load_ours, save_hf_model

TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tmp_path, tie):
    pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")
    reference = save_hf_model(tmp_path, "olmo2", tie=tie)
    assert reference.model.layers[0].self_attn.q_norm.weight.shape == (64,)  # every head's features
    with torch.no_grad():
        expected = reference(input_ids=TOKENS).logits
        assert expected.std() > 0.5
        torch.testing.assert_close(load_ours(tmp_path)(TOKENS), expected, rtol=1e-5, atol=1e-5)


def test_post_norms_round_as_transformers_in_bf16():
    """The post-norms and the final norm apply their weight in float32 before the cast back, as
    Olmo2RMSNorm does (the shared RMSNorm casts first: a different bf16 result)."""
    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2", reason="the reference; a test-only extra")
    from titan_lightning.models.common import RMSNorm
    from titan_lightning.models.olmo2.model import Olmo2RMSNorm

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 16, 64, generator=g).bfloat16(), 1 + 0.3 * torch.randn(64, generator=g)
    theirs, ours, shared = olmo2.Olmo2RMSNorm(64, eps=1e-6), Olmo2RMSNorm(64, 1e-6), RMSNorm(64, 1e-6)
    for norm in (theirs, ours, shared):
        norm.weight.data.copy_(w)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
        assert not torch.equal(shared(x), theirs(x))


def test_the_qk_norm_spans_every_head():
    """Scaling one head's queries changes the others' after the norm (a per-head norm would not)."""
    from titan_lightning.models.olmo2 import ProjectionNorm

    norm = ProjectionNorm(4 * 8, 1e-6)
    q = torch.randn(1, 3, 4, 8)
    louder = q.clone()
    louder[:, :, 0] *= 10
    assert not torch.allclose(norm(q)[:, :, 1:], norm(louder)[:, :, 1:])
    flat = q.flatten(-2)
    torch.testing.assert_close(norm(q).flatten(-2), flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6))


def _config(tmp_path, **fields):
    config = {"model_type": "olmo2", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 64, "rope_theta": 5e5, "rope_scaling": None, "hidden_act": "silu",
              "attention_dropout": 0.0, "attention_bias": False, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("fields, message", [
    ({"attention_bias": True}, "attention_bias=true is not supported by Olmo2"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "RoPE scaling .* is not modelled for Olmo2"),
    ({"hidden_act": "gelu"}, 'hidden_act="gelu" is not supported'),
    ({"sliding_window": 8}, "sliding_window=8 not modelled by Olmo2"),
])
def test_what_olmo2_does_not_model_is_refused_by_name(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        read_hf_model(_config(tmp_path, **fields))


# The model cards' parameter counts.
PUBLISHED = {"1B": 1.48e9, "7B": 7.30e9, "13B": 13.7e9, "32B": 32.2e9}


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_presets_have_the_model_cards_parameter_counts(flavor):
    from titan_lightning.models.olmo2 import Transformer, olmo2_args

    assert Transformer.count_parameters(olmo2_args(flavor)) == pytest.approx(PUBLISHED[flavor], rel=0.01)


_OLMO2 = {"architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
          "eos_token_id": 100257, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 4096,
          "model_type": "olmo2", "pad_token_id": 100277, "rms_norm_eps": 1e-06, "rope_scaling": None,
          "rope_theta": 500000, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 100352}
# config.json of OLMo-2-0425-1B, OLMo-2-1124-7B, OLMo-2-1124-13B and OLMo-2-0325-32B as published.
RELEASED = {
    "1B": {**_OLMO2, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16,
           "num_hidden_layers": 16, "num_key_value_heads": 16, "torch_dtype": "float32",
           "transformers_version": "4.48.3"},
    "7B": {**_OLMO2, "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
           "num_hidden_layers": 32, "num_key_value_heads": 32, "torch_dtype": "float32",
           "transformers_version": "4.47.0.dev0"},
    "13B": {**_OLMO2, "hidden_size": 5120, "intermediate_size": 13824, "num_attention_heads": 40,
            "num_hidden_layers": 40, "num_key_value_heads": 40, "torch_dtype": "float32",
            "transformers_version": "4.47.0.dev0"},
    "32B": {**_OLMO2, "hidden_size": 5120, "intermediate_size": 27648, "num_attention_heads": 40,
            "num_hidden_layers": 64, "num_key_value_heads": 8, "torch_dtype": "bfloat16",
            "transformers_version": "4.50.0.dev0"},
}


@pytest.mark.parametrize("flavor", RELEASED)
def test_a_released_config_json_reads_as_its_preset(tmp_path, flavor):
    from titan_lightning.models.olmo2 import olmo2_args
    from titan_lightning.pretrained import check_folder_matches

    (tmp_path / "config.json").write_text(json.dumps(RELEASED[flavor]))
    assert read_hf_model(tmp_path).args == olmo2_args(flavor)
    check_folder_matches(olmo2_args(flavor), Olmo2StateDictAdapter, tmp_path)
