"""Hugging Face DeepSeek V3 folders: config.json read and written field by field, checkpoints (FP8
block-scaled ones too) loaded through our adapter give transformers' logits."""

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from titan_lightning.config import ConfigError
from titan_lightning.models.common.hf_checkpoint import HFTensors
from titan_lightning.models.common.hf_config import HFConfig, read_config_json
from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.deepseek_v3 import DeepSeekV3Args, Transformer, deepseek_v3_args
from titan_lightning.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter as Adapter
from titan_lightning.models.deepseek_v3.state_dict_adapter import dequantized


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="transformers is not a dependency; the GPU machine has it")


# Plain RoPE, and YaRN (positions past original_seq_len: stretched frequencies, mscale).
ROPE = {
    "rope": dict(max_seq_len=64, original_seq_len=64),
    "yarn": dict(max_seq_len=128, original_seq_len=32, rope_factor=4.0, mscale=0.707),
}


def tiny_args(q_lora_rank: int, rope: dict, **fields) -> DeepSeekV3Args:
    moe = MoEArgs(num_experts=8, top_k=2, hidden_dim=32, num_shared_experts=1, score_func="sigmoid",
                  route_norm=True, route_scale=2.5, num_groups=4, top_k_groups=2)
    return DeepSeekV3Args(**{**dict(
        vocab_size=512, dim=64, n_layers=3, n_dense_layers=1, inter_dim=96, n_heads=4, n_kv_heads=4, norm_eps=1e-6,
        q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        moe=moe, **rope,
    ), **fields})  # fmt: skip


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from transformers' init (norms not ones, a routing bias), fp32."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.1 * noise if name.endswith("layernorm.weight") or name == "model.norm.weight" else 0.1 * noise)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))


def read(config: dict, source: str = "folder/config.json") -> DeepSeekV3Args:
    """``config`` as the recipe reads a folder's config.json: every field mapped, checked or refused."""
    reader = HFConfig(config, source=source, family="DeepSeek V3")
    args = Adapter.args_from_hf_config(reader)
    reader.finish()
    return args


def loaded(args: DeepSeekV3Args, folder) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed=1)
    Adapter(args).load_into(model, folder)
    return model.eval()


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


TOKENS = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("rope", ROPE)
@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_exported_config_builds_transformers_model_with_our_logits(q_lora_rank, rope, tmp_path, transformers):
    args = tiny_args(q_lora_rank, ROPE[rope])
    (tmp_path / "config.json").write_text(json.dumps(Adapter.hf_config(args)))
    reference = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    reference = reference.float().eval()
    randomize(reference, seed=0)
    reference.save_pretrained(tmp_path)
    assert read(read_config_json(tmp_path)) == args  # through transformers' own save of our config.json

    expected = logits(reference, TOKENS)
    assert expected.std() > 0.1  # the logits depend on the weights, not a constant
    torch.testing.assert_close(logits(loaded(args, tmp_path), TOKENS), expected, rtol=0, atol=1e-5)


# transformers-saved configs that exercise what our defaults would get wrong: its latent norms at
# 1e-6 under another rms_norm_eps, and experts limited to the best groups (with YaRN, given in
# transformers 4's spelling, which transformers 5 saves under both ``type`` and ``rope_type``).
SAVED = {
    "latent_eps": (dict(rms_norm_eps=1e-2, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                        topk_group=1, max_position_embeddings=64), dict(latent_norm_eps=None)),
    "groups": (dict(rms_norm_eps=1e-6, q_lora_rank=None, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                    topk_group=2, max_position_embeddings=128,
                    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                  "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
               dict(top_k_groups=4)),
}


@pytest.mark.parametrize("case", SAVED)
def test_transformers_saved_folder_gives_transformers_logits(case, tmp_path, transformers):
    fields, ablation = SAVED[case]
    config = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32, n_shared_experts=1,
        routed_scaling_factor=2.5, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, **fields,
    )  # fmt: skip
    reference = transformers.DeepseekV3ForCausalLM(config).float().eval()
    randomize(reference, seed=0)
    reference.save_pretrained(tmp_path)

    args = read(read_config_json(tmp_path))
    expected = logits(reference, TOKENS)
    torch.testing.assert_close(logits(loaded(args, tmp_path), TOKENS), expected, rtol=0, atol=1e-5)
    # Without the mapped field (latent norms at rms_norm_eps; every group allowed) the logits differ.
    if "latent_norm_eps" in ablation:
        other = dataclasses.replace(args, **ablation)
    else:
        other = dataclasses.replace(args, moe=dataclasses.replace(args.moe, **ablation))
    assert (logits(loaded(other, tmp_path), TOKENS) - expected).abs().max() > 1e-3


# deepseek-ai/DeepSeek-V3's config.json, as published (FP8 weights, a multi-token-prediction layer).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
# moonshotai/Moonlight-16B-A3B's: DeepSeek-V2-Lite's shapes (no query compression, 64 experts)
# under DeepSeek V3's routing, plain RoPE, rms_norm_eps 1e-5.
MOONLIGHT = {
    **{k: v for k, v in DEEPSEEK_V3.items() if k not in ("quantization_config", "rope_scaling")},
    "first_k_dense_replace": 1, "hidden_size": 2048, "intermediate_size": 11264, "max_position_embeddings": 8192,
    "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "num_nextn_predict_layers": 0, "q_lora_rank": None, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 50000.0, "routed_scaling_factor": 2.446, "topk_group": 1, "vocab_size": 163840,
}  # fmt: skip


def test_published_configs_read_as_the_models_they_describe():
    # The 671B preset, at transformers' YaRN length (40 x 4096 positions; the preset caches 16,384).
    assert read(DEEPSEEK_V3) == dataclasses.replace(deepseek_v3_args("671B"), max_seq_len=163840)
    args = read(MOONLIGHT)
    assert (args.dim, args.n_layers, args.n_dense_layers, args.q_lora_rank, args.max_seq_len) == (2048, 27, 1, 0, 8192)
    assert not args.uses_yarn and args.rope_theta == 50000.0
    assert (args.norm_eps, args.latent_norm_eps) == (1e-5, 1e-6)  # transformers' latent norms
    assert args.moe == MoEArgs(num_experts=64, top_k=6, hidden_dim=1408, num_shared_experts=2, score_func="sigmoid",
                               route_norm=True, route_scale=2.446, num_groups=1, top_k_groups=1)


def test_671b_preset_exports_the_published_config(transformers):
    config = Adapter.hf_config(deepseek_v3_args("671B"))
    published = {k: v for k, v in DEEPSEEK_V3.items() if k in config and k not in ("rope_scaling", "rope_theta")}
    assert {k: config[k] for k in published} == {**published, "num_nextn_predict_layers": 0}
    assert Adapter.hf_config(read(config)) == config  # a fixed point
    hf = transformers.DeepseekV3Config(**config)
    assert (hf.n_group, hf.topk_group, hf.rope_parameters["factor"], hf.max_position_embeddings) == (8, 4, 40, 163840)


@pytest.mark.parametrize("change, message", [
    (dict(scoring_func="softmax"),
     r'scoring_func="softmax" is not supported by DeepSeek V3 here \(supported: "sigmoid"\)'),
    (dict(topk_method="group_limited_greedy"), r'topk_method="group_limited_greedy" is not supported.*"noaux_tc"'),
    (dict(moe_layer_freq=2), r"moe_layer_freq=2 is not supported.*supported: 1\)"),
    (dict(rope_interleave=False), r"rope_interleave=false is not supported.*supported: true\)"),
    (dict(head_dim=192), r"head_dim=192 is not supported.*supported: 64\)"),
    (dict(qk_head_dim=128), r"qk_head_dim=128 is not supported.*supported: 192\)"),
    (dict(hidden_size=None), r"hidden_size is missing; DeepSeek V3 needs it"),
    (dict(index_topk=2048), r"index_topk=2048 not modelled by DeepSeek V3 here"),
    (dict(quantization_config={"quant_method": "awq"}), r'quantization_config: quant_method="awq" is not supported'),
    (dict(quantization_config={"quant_method": "fp8", "fmt": "e5m2"}), r'quantization_config: fmt="e5m2" is not'),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]}),
     r"quantization_config: weight_block_size=\[64, 64\] is not supported.*\[128, 128\]"),
    (dict(quantization_config={"quant_method": "fp8", "activation_scheme": "static"}),
     r'quantization_config: activation_scheme="static" is not'),
    (dict(quantization_config={"quant_method": "fp8", "modules_to_not_convert": ["lm_head"]}),
     r'quantization_config: modules_to_not_convert=\["lm_head"\] not modelled'),
    (dict(rope_scaling={**DEEPSEEK_V3["rope_scaling"], "mscale_all_dim": 0.707}),
     r"rope_scaling: mscale=1.0 and mscale_all_dim=0.707 differ: transformers then scales the rotary features alone"),
    (dict(rope_scaling={**DEEPSEEK_V3["rope_scaling"], "factor": 1}),
     r"rope_scaling: factor=1; YaRN here needs a factor > 1"),
    (dict(rope_scaling={**DEEPSEEK_V3["rope_scaling"], "truncate": False}),
     r"yarn RoPE field\(s\) truncate not modelled"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), r'rope_type="dynamic" is not supported here'),
])  # fmt: skip
def test_unsupported_config_fields_are_refused_by_name(change, message):
    config = {k: v for k, v in {**DEEPSEEK_V3, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        read(config)


@pytest.mark.parametrize("args, message", [
    (deepseek_v3_args("debugmodel"),
     r"model\.moe\.score_func='softmax': Hugging Face DeepSeek V3 scores experts with 'sigmoid' only"),
    (tiny_args(0, ROPE["rope"], norm_eps=1e-5),
     r"model\.latent_norm_eps=None \(latent norms at eps 1e-05\): Hugging Face DeepSeek V3 uses 1e-06 there; "
     r"export needs "
     r"model\.latent_norm_eps=1e-06"),
    (tiny_args(0, ROPE["yarn"], rope_factor=0.5),
     r"model\.rope_factor=0\.5: Hugging Face YaRN stretches RoPE by a factor > 1"),
    (tiny_args(0, ROPE["rope"], moe=MoEArgs(score_func="sigmoid", score_before_experts=True)),
     r"model\.moe\.score_before_experts=True: Hugging Face DeepSeek V3 weights the experts' outputs; "
     r"export needs False"),
])  # fmt: skip
def test_models_transformers_cannot_express_are_refused_on_export(args, message):
    with pytest.raises(ConfigError, match=message):
        Adapter.hf_config(args)


# -- FP8 block-scaled checkpoints (the published 671B) ---------------------------------------------

BLOCK = 128


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` in float8_e4m3fn with one float32 ``weight_scale_inv`` per 128 x 128 block (DeepSeek's layout)."""
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            scale[i, j] = tile.abs().max() / 448.0
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: each block's float8 values times its scale."""
    w = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] *= scale[i, j]
    return w


def test_fp8_checkpoint_loads_as_its_dequantized_weights(tmp_path):
    args = tiny_args(24, ROPE["rope"], inter_dim=200, dim=160)  # blocks cropped at the edges
    model = Transformer(args)
    model.init_weights(seed=0)
    hf = Adapter(args).to_hf(model.state_dict())
    hf["model.layers.3.eh_proj.weight"] = torch.randn(160, 320)  # a multi-token-prediction layer: skipped
    saved, reference = {}, {}
    for key, w in hf.items():
        if key.endswith("proj.weight") and ".layers." in key:  # projections, not norms, router or embeddings
            q, scale = quantize(w)
            saved[key], saved[key + "_scale_inv"], reference[key] = q, scale, dequantize(q, scale)
        else:
            saved[key] = reference[key] = w
    assert saved["model.layers.0.mlp.gate_proj.weight"].shape == (200, 160)  # 2 x 2 blocks, both cropped
    save_file(saved, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = {**Adapter.hf_config(args), "quantization_config": DEEPSEEK_V3["quantization_config"]}
    assert read(config) == args

    loaded_model = Transformer(args)
    loaded_model.init_weights(seed=1)
    Adapter(args).load_into(loaded_model, tmp_path)
    expected = Adapter(args).from_hf({k: v for k, v in reference.items() if ".layers.3." not in k})
    got = loaded_model.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    # A sharded parameter reads its block alone, across block edges and off their grid.
    tensors = dequantized(HFTensors.open(tmp_path))
    assert "model.layers.0.mlp.gate_proj.weight_scale_inv" not in tensors.keys()
    for index in [(slice(70, 190), slice(30, 150)), (slice(128, 200), slice(0, 160)), (slice(5, 5), slice(0, 160))]:
        block = tensors.read("model.layers.0.mlp.gate_proj.weight", index)
        assert torch.equal(block, reference["model.layers.0.mlp.gate_proj.weight"][index])


O_PROJ = "model.layers.0.self_attn.o_proj.weight"
FP8 = torch.zeros(200, 64).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("tensors, message", [
    ({O_PROJ: FP8}, r"model\.layers\.0\.self_attn\.o_proj\.weight is float8_e4m3fn but "
                    r"model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv is missing"),
    ({O_PROJ: FP8, O_PROJ + "_scale_inv": torch.ones(1, 1)},
     r"o_proj\.weight_scale_inv has shape \[1, 1\], expected \[2, 1\] \(one scale per 128x128 block of the "
     r"\[200, 64\] weight\)"),
    ({O_PROJ: torch.zeros(200, 64), O_PROJ + "_scale_inv": torch.ones(2, 1)},
     r"o_proj\.weight_scale_inv: a block scale, but model\.layers\.0\.self_attn\.o_proj\.weight is "
     r"torch\.float32, not float8_e4m3fn"),
    ({O_PROJ + "_scale_inv": torch.ones(2, 1)},
     r"o_proj\.weight_scale_inv: a block scale without its weight model\.layers\.0\.self_attn\.o_proj\.weight"),
    ({O_PROJ: torch.zeros(200, 64).to(torch.float8_e5m2)},
     r"o_proj\.weight is torch\.float8_e5m2; only float8_e4m3fn weights with block scales are read"),
    ({"model.layers.0.mlp.gate.e_score_correction_bias": torch.zeros(8).to(torch.float8_e4m3fn),
      "model.layers.0.mlp.gate.e_score_correction_bias_scale_inv": torch.ones(1)},
     r"e_score_correction_bias_scale_inv: block scales for model\.layers\.0\.mlp\.gate\.e_score_correction_bias "
     r"of shape \[8\]; they need a matrix"),
])  # fmt: skip
def test_bad_fp8_tensors_name_the_hugging_face_key(tensors, message):
    with pytest.raises(ValueError, match=message):
        Adapter(tiny_args(0, ROPE["rope"])).from_hf(tensors)
