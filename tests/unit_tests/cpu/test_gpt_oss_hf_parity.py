"""A Hugging Face gpt-oss folder (tiny, random fp32 weights: sliding and full layers, non-zero
sinks, YaRN, 8 experts with biases), read through config.json and our adapter, gives the logits
transformers computes from it (its export: test_export_hf_parity.py); an MXFP4 folder
(the published checkpoints' format) loads dequantized as transformers dequantizes it; YaRN's
frequencies are transformers'; the published config.json files read as the 20B and 120B presets."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_lightning.config import ConfigError
from titan_lightning.models.gpt_oss import GptOssStateDictAdapter, GptOssYarn, Transformer, gpt_oss_args
from titan_lightning.models.gpt_oss.model import yarn_frequencies
from titan_lightning.models.gpt_oss.state_dict_adapter import dequantize_mxfp4
from titan_lightning.pretrained import check_folder_matches, read_hf_model

from tests.hf_folders import VOCAB, load_ours, save_hf_model

TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny folder and transformers' logits of TOKENS (layer 0 slides over 8 of 24 tokens)."""
    pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")
    path = tmp_path_factory.mktemp("gpt_oss")
    reference = save_hf_model(path, "gpt_oss")
    assert reference.config.layer_types == ["sliding_attention", "full_attention"]
    with torch.no_grad():
        return path, reference(input_ids=TOKENS).logits


def test_logits_match_transformers(folder):
    path, expected = folder
    ours = load_ours(path)
    assert (ours.args.sliding_window, ours.args.layer_types) == (8, ["sliding_attention", "full_attention"])
    assert all(layer.attention.sinks.weight.abs().min() > 0 for layer in ours.layers.values())
    with torch.no_grad():
        assert expected.std() > 0.5
        torch.testing.assert_close(ours(TOKENS), expected, rtol=1e-4, atol=1e-4)
        for layer in ours.layers.values():  # without the sinks (or the window) the logits differ
            layer.attention.sinks.weight.fill_(-1e4)
        assert (ours(TOKENS) - expected).abs().max() > 1e-2


def _pack_mxfp4(w: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks and scales of the checkpoint layout for a fused weight [E, a, b]:
    blocks [E, b, a / 32, 16], scales [E, b, a / 32] (around 2^-4, so values stay O(0.1-1))."""
    E, a, b = w.shape
    blocks = torch.randint(0, 256, (E, b, a // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 126, (E, b, a // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantization_is_transformers(folder, tmp_path):
    """Our dequantization of a packed tensor equals transformers' own, and an MXFP4 folder (the
    experts' weights as *_blocks / *_scales, quantization_config mxfp4) loads as the dequantized
    model: logits equal transformers' on the same dequantized weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks, scales = _pack_mxfp4(torch.empty(2, 64, 96), g)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, 64, 96]
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs, rtol=0, atol=0)

    path, _ = folder
    packed = tmp_path / "mxfp4"
    packed.mkdir()
    tensors = load_file(str(path / "model.safetensors"))
    dequantized = {}
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = _pack_mxfp4(tensors.pop(key), g)
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        dequantized[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, str(packed / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(config))
    ours = load_ours(packed)

    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        reference.load_state_dict({**reference.state_dict(), **dequantized})
        torch.testing.assert_close(ours(TOKENS), reference(input_ids=TOKENS).logits, rtol=1e-4, atol=1e-4)
    (packed / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ConfigError, match='quant_method="fp8" is not supported'):
        read_hf_model(packed)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_and_scale_are_transformers(truncate):
    pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 4096, "truncate": truncate}
    config = GptOssConfig(hidden_size=2880, num_attention_heads=64, head_dim=64, rope_parameters=rope)
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](config)
    yarn = GptOssYarn(factor=32.0, original_max_position_embeddings=4096, truncate=truncate)
    torch.testing.assert_close(yarn_frequencies(64, 150000.0, yarn), inv_freq, rtol=0, atol=0)
    assert yarn.scale == scale


def _config(tmp_path, **fields):
    config = {"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
              "sliding_window": 8, "rope_theta": 10000.0, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_transformers_defaults_when_config_json_leaves_fields_out(tmp_path):
    args = read_hf_model(_config(tmp_path)).args
    assert args.layer_types == ["sliding_attention", "full_attention"]  # alternating, sliding first
    assert args.rope_scaling is None and args.moe.load_balance_coeff is None
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    yarn = read_hf_model(_config(tmp_path, rope_scaling=scaling)).args.rope_scaling
    assert (yarn.beta_fast, yarn.beta_slow, yarn.truncate) == (32.0, 1.0, True)  # transformers' defaults


@pytest.mark.parametrize("fields, message", [
    ({"attention_bias": False}, "attention_bias=false is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0}},
     "yarn RoPE field.s. mscale=1.0 not modelled"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 'rope_type="linear" is not supported'),
    ({"experts_per_token": 4}, "experts_per_token=4 differs from num_experts_per_tok=2"),
    ({"quantization_config": {"quant_method": "mxfp4", "group_size": 64}}, "group_size=64 not modelled"),
    ({"use_sink_gate": True}, "use_sink_gate=true not modelled"),
])
def test_what_gpt_oss_does_not_model_is_refused_by_name(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        read_hf_model(_config(tmp_path, **fields))


# gpt-oss-20b's config.json as published (openai/gpt-oss-20b); 120b differs in layers and experts.
RELEASED_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}
RELEASED = {"20B": RELEASED_20B, "120B": {**RELEASED_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                                          "layer_types": ["sliding_attention", "full_attention"] * 18}}


@pytest.mark.parametrize("flavor", RELEASED)
def test_a_released_config_json_reads_as_its_preset(tmp_path, flavor):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED[flavor]))
    preset = gpt_oss_args(flavor)
    preset.moe = dataclasses.replace(preset.moe, load_balance_coeff=None)  # from a folder: no routing bias
    assert read_hf_model(tmp_path).args == preset
    check_folder_matches(gpt_oss_args(flavor), GptOssStateDictAdapter, tmp_path)


# OpenAI's model card: 20.9B total / 3.6B active, 116.8B / 5.1B (active without the embeddings).
@pytest.mark.parametrize("flavor, total, active", [("20B", 20.9e9, 3.6e9), ("120B", 116.8e9, 5.1e9)])
def test_presets_have_the_published_parameter_counts(flavor, total, active):
    args = gpt_oss_args(flavor)
    embeddings = args.vocab_size * args.dim
    assert Transformer.count_parameters(args) == pytest.approx(total, rel=0.005)
    assert Transformer.count_parameters(args, active=True) - embeddings == pytest.approx(active, rel=0.01)


@pytest.mark.parametrize("attention, degrees, message", [
    ("ring", dict(cp=2, dp_shard=1), "model.attention='ring': gpt-oss's attention sinks are computed by sdpa, flex"),
    ("ulysses", dict(cp=2, dp_shard=1), "model.attention='ulysses'"),
    ("varlen", dict(dp_shard=2), "model.attention='varlen'"),
    ("sdpa", dict(dp_shard=1, tp=2), "parallelism.tp=2 with parallelism.ep=1 makes the experts tensor-parallel"),
])
def test_layouts_the_sinks_or_expert_biases_cannot_take_are_refused_before_launch(attention, degrees, message):
    """Every other layout equals one process (allgather CP2, TP2 x EP2, TP2 x CP2 x EP4: checked with
    scripts/loss_compare.py; the models suite runs FSDP2 x EP2)."""
    from recipes.tests.models import gpt_oss_debugmodel
    from titan_lightning.config import validate_job
    from titan_lightning.recipe import on_layout

    run = on_layout(gpt_oss_debugmodel(), **degrees)
    run.job.model.attention = attention
    with pytest.raises(ConfigError, match=message):
        validate_job(run.job, world_size=2)
