"""A Hugging Face Qwen2 folder (tiny, random fp32 weights, q/k/v biases), read through config.json
and our adapter, gives the logits transformers computes from it (tied and untied embeddings); with
sliding layers, its export too (the export of each family: test_export_hf_parity.py); a config.json
that slides its attention is refused."""

import json

import pytest
import torch

from titan_lightning.config import ConfigError
from titan_lightning.models.qwen2 import Qwen2StateDictAdapter
from titan_lightning.pretrained import read_hf_model

from tests.hf_folders import VOCAB, assert_transformers_agrees, export_hf, load_ours, save_hf_model

TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tmp_path, tie):
    pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")
    reference = save_hf_model(tmp_path, "qwen2", tie=tie)
    assert reference.model.layers[0].self_attn.q_proj.bias.abs().max() > 0.1  # the biases count
    with torch.no_grad():
        expected = reference(input_ids=TOKENS).logits
        assert expected.std() > 0.5
        torch.testing.assert_close(load_ours(tmp_path)(TOKENS), expected, rtol=1e-5, atol=1e-5)


def _config(tmp_path, **fields):
    config = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 64, "rope_theta": 1e6, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 2, "hidden_act": "silu", "attention_dropout": 0.0, "use_mrope": False, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_released_config_reads_with_its_window_fields_switched_off(tmp_path):
    args = read_hf_model(_config(tmp_path)).args
    assert (args.dim, args.head_dim, args.n_kv_heads, args.qkv_bias) == (64, 16, 2, True)


def test_sliding_layers_from_max_window_layers_read_export_and_match_transformers(tmp_path):
    """use_sliding_window on: the layers from max_window_layers on slide (transformers' rule)."""
    pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")
    reference = save_hf_model(tmp_path / "hf", "qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1)
    ours = load_ours(tmp_path / "hf")
    assert (ours.args.sliding_window, ours.args.layer_types) == (6, ["full_attention", "sliding_attention"])
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), reference(input_ids=TOKENS).logits, rtol=1e-5, atol=1e-5)
    export = export_hf(ours, Qwen2StateDictAdapter, tmp_path / "export")
    theirs = assert_transformers_agrees(export, ours, TOKENS, rtol=1e-5, atol=1e-5)
    assert theirs.config.layer_types == ["full_attention", "sliding_attention"]


def test_sliding_fields_read_as_transformers_reads_them(tmp_path):
    read = lambda **f: (lambda a: (a.sliding_window, a.layer_types))(read_hf_model(_config(tmp_path, **f)).args)  # noqa: E731
    assert read() == (None, None)  # switched off: the window's size changes nothing
    assert read(use_sliding_window=True, sliding_window=8, max_window_layers=0) == (8, None)  # every layer
    assert read(use_sliding_window=True, sliding_window=8, max_window_layers=2) == (None, None)  # none
    assert read(use_sliding_window=True, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"]) == (8, ["sliding_attention", "full_attention"])


@pytest.mark.parametrize("fields, message", [
    ({"use_sliding_window": True, "sliding_window": None, "layer_types": ["full_attention", "sliding_attention"]},
     "layer_types has sliding layers but sliding_window=null"),
    ({"use_sliding_window": True, "layer_types": ["full_attention", "local"]}, 'layer_types=\\["full_attention", "local"\\]'),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "RoPE scaling"),
    ({"use_mrope": True}, "use_mrope=true is not supported"),
])
def test_what_qwen2_does_not_model_is_refused_by_name(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        read_hf_model(_config(tmp_path, **fields))


# The Qwen 2.5 model cards' (total, non-embedding) parameters, as rounded there. 0.5B, 1.5B and 3B
# tie lm_head to the embeddings; we never tie, so ours is the card's plus vocab_size * dim.
PUBLISHED = {"0.5B": (0.49e9, 0.36e9), "1.5B": (1.54e9, 1.31e9), "3B": (3.09e9, 2.77e9), "7B": (7.61e9, 6.53e9),
             "14B": (14.7e9, 13.1e9), "32B": (32.5e9, 31.0e9), "72B": (72.7e9, 70.0e9)}


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_presets_have_the_model_cards_parameter_counts(flavor):
    from titan_lightning.models.qwen2 import Transformer, qwen2_args

    args = qwen2_args(flavor)
    total, embedding = Transformer.count_parameters(args), args.vocab_size * args.dim
    card = total - embedding if flavor in ("0.5B", "1.5B", "3B") else total
    assert (card, total - 2 * embedding) == pytest.approx(PUBLISHED[flavor], rel=0.01)


_QWEN25 = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
           "eos_token_id": 151643, "hidden_act": "silu", "initializer_range": 0.02, "model_type": "qwen2",
           "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
           "use_cache": True, "use_mrope": False, "use_sliding_window": False}
# Qwen2.5-7B's and Qwen2.5-0.5B's config.json as published (sliding-window fields present, switched off).
RELEASED = {
    "7B": {**_QWEN25, "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 131072,
           "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
           "sliding_window": 131072, "tie_word_embeddings": False, "vocab_size": 152064},
    "0.5B": {**_QWEN25, "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
             "max_window_layers": 24, "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
             "sliding_window": 32768, "tie_word_embeddings": True, "vocab_size": 151936},
}


@pytest.mark.parametrize("flavor", RELEASED)
def test_a_released_config_json_reads_as_its_preset(tmp_path, flavor):
    from titan_lightning.models.qwen2 import qwen2_args
    from titan_lightning.pretrained import check_folder_matches

    (tmp_path / "config.json").write_text(json.dumps(RELEASED[flavor]))
    assert read_hf_model(tmp_path).args == qwen2_args(flavor)
    check_folder_matches(qwen2_args(flavor), Qwen2StateDictAdapter, tmp_path)
