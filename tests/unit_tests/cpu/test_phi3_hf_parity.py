"""A Hugging Face Phi3 folder (tiny, random fp32 weights; fused qkv_proj and gate_up_proj, RoPE on 3/4
of each head as Phi-4-mini), read through config.json and our adapter, gives the logits transformers
computes from it: tied and untied, with a sliding window, with LongRoPE's short factors and its long
ones, and then exported to transformers (the export of each family: test_export_hf_parity.py); what Phi3
does not model is refused by name."""

import dataclasses
import json
import math

import pytest
import torch

from titan_lightning.config import ConfigError
from titan_lightning.models.common.safetensors_io import HFTensors
from titan_lightning.models.phi3 import Phi3StateDictAdapter
from titan_lightning.pretrained import read_hf_model

from tests.hf_folders import VOCAB, assert_transformers_agrees, export_hf, load_ours, save_hf_model

TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
# LongRoPE on a 16-token original length: 24 tokens take the long factors, 12 the short ones.
LONGROPE = dict(original_max_position_embeddings=16, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
    "short_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0], "long_factor": [2.0, 4.0, 8.0, 16.0, 32.0, 64.0]})


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tmp_path, tie):
    pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")
    reference = save_hf_model(tmp_path, "phi3", tie=tie)
    assert reference.model.layers[0].self_attn.qkv_proj.weight.shape == (64 + 2 * 32, 64)  # fused in the folder
    with torch.no_grad():
        expected = reference(input_ids=TOKENS).logits
        assert expected.std() > 0.5
        ours = load_ours(tmp_path)
        assert ours.args.rotary_dim == 12
        torch.testing.assert_close(ours(TOKENS), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length, factors", [(24, "long"), (12, "short")])
def test_longrope_factors_and_a_sliding_window_match_transformers(tmp_path, length, factors):
    """transformers picks the factor set by the batch's length; ours is the run's (``factors``)."""
    pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")
    reference = save_hf_model(tmp_path / "hf", "phi3", sliding_window=6, **LONGROPE)
    ours = load_ours(tmp_path / "hf")
    s = ours.args.rope_scaling
    assert (ours.args.sliding_window, s.original_max_position_embeddings, s.factors) == (6, 16, "short")
    assert s.attention_factor == pytest.approx((1 + math.log(64 / 16) / math.log(16)) ** 0.5)  # transformers' default
    tokens = TOKENS[:, :length]
    if factors == "long":
        args = dataclasses.replace(ours.args, rope_scaling=dataclasses.replace(s, factors="long"))
        long = type(ours)(args)
        long.load_state_dict(ours.state_dict())
        ours = long.eval()
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-5, atol=1e-5)
        other = "short" if factors == "long" else "long"
        for wrong in (dataclasses.replace(ours.args, rope_scaling=dataclasses.replace(s, factors=other)),
                      dataclasses.replace(ours.args, sliding_window=None)):  # the factor set and the window count
            model = type(ours)(wrong)
            model.load_state_dict(ours.state_dict())
            assert (model.eval()(tokens) - expected).abs().max() > 1e-2
    theirs = assert_transformers_agrees(export_hf(ours, Phi3StateDictAdapter, tmp_path / "export"), ours, tokens,
                                        rtol=1e-5, atol=1e-5)
    assert theirs.config.sliding_window == 6 and theirs.config.rope_parameters["rope_type"] == "longrope"


def test_an_export_fuses_a_layers_parts_together_and_refuses_a_part_alone():
    from titan_lightning.models.phi3 import Transformer, phi3_args

    args = dataclasses.replace(phi3_args("debugmodel"), n_layers=1)
    adapter = Phi3StateDictAdapter(args)
    state = Transformer(args).state_dict()
    hf = adapter.to_hf(state)
    assert hf["model.layers.0.self_attn.qkv_proj.weight"].shape == (256 + 2 * 128, 256)
    assert hf["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 768, 256)
    projections = [k for k in state if k.startswith(("layers.0.attention.w", "layers.0.feed_forward."))]
    assert {adapter.export_group(k) for k in projections} == {
        "layers.0.qkv", "layers.0.gate_up", "layers.0.attention.wo.weight", "layers.0.feed_forward.w2.weight"}
    with pytest.raises(ValueError, match=r"weight\[k\], model.layers.0.self_attn.qkv_proj.weight\[v\] not given"):
        adapter.to_hf({"layers.0.attention.wq.weight": state["layers.0.attention.wq.weight"]})
    back = adapter.from_hf(hf)
    assert all(torch.equal(back[k], state[k]) for k in state)
    read = []  # a rank's block of wk (a TP shard: its heads) reads only those rows of qkv_proj
    tensors = HFTensors({k: tuple(v.shape) for k, v in hf.items()},
                        lambda name, index: read.append((name, index)) or hf[name][index])
    block = adapter.sources(tensors)["layers.0.attention.wk.weight"].read((slice(64, 128), slice(0, 256)))
    assert torch.equal(block, state["layers.0.attention.wk.weight"][64:128])
    assert read == [("model.layers.0.self_attn.qkv_proj.weight", (slice(256 + 64, 256 + 128), slice(0, 256)))]


def _config(tmp_path, **fields):
    config = {"model_type": "phi3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 64, "original_max_position_embeddings": 64, "rope_theta": 1e4,
              "rope_scaling": None, "sliding_window": None, "hidden_act": "silu", "attention_dropout": 0.0,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("fields, message", [
    ({"resid_pdrop": 0.1}, "resid_pdrop=0.1 is not supported"),
    ({"embd_pdrop": 0.1}, "embd_pdrop=0.1 is not supported"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, 'rope_type="yarn" is not supported by Phi3'),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8, "mscale": 2.0}},
     "longrope RoPE field\\(s\\) mscale not modelled"),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 7, "long_factor": [1.0] * 7}},
     "rope_scaling has 7 factors; RoPE turns 8 feature pairs"),
    ({"partial_rotary_factor": 0.33}, "rotary_dim=5 must be even"),
    ({"hidden_act": "gelu"}, "hidden_act=\"gelu\" is not supported"),
])
def test_what_phi3_does_not_model_is_refused_by_name(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        read_hf_model(_config(tmp_path, **fields))


def test_the_factor_set_must_be_the_one_transformers_takes_for_the_runs_length(tmp_path):
    from titan_lightning.models.phi3 import Phi3Job, Phi3Module

    args = read_hf_model(_config(tmp_path, max_position_embeddings=256, rope_scaling={
        "type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})).args
    assert args.rope_scaling.factors == "short" and args.max_seq_len == 256
    job = Phi3Job(model=args)
    job.training.seq_len = 64
    Phi3Module.check_config(job)
    job.training.seq_len = 128
    with pytest.raises(ConfigError, match="model.rope_scaling.factors='short' with training.seq_len=128: transformers "
                                          "turns sequences of 128 tokens with the long factors"):
        Phi3Module.check_config(job)
    job.model.rope_scaling.factors = "long"
    Phi3Module.check_config(job)
    job.model.positions = "per_document"
    with pytest.raises(ConfigError, match="model.positions='per_document' with the long LongRoPE factors"):
        Phi3Module.check_config(job)


# The model cards' parameter counts (Phi-4-mini ties lm_head: ours has vocab_size * dim more).
PUBLISHED = {"mini-4k": 3.82e9, "medium-4k": 14.0e9, "phi-4": 14.7e9, "phi-4-mini": 3.84e9}


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_presets_have_the_model_cards_parameter_counts(flavor):
    from titan_lightning.models.phi3 import Transformer, phi3_args

    args = phi3_args(flavor)
    total = Transformer.count_parameters(args)
    card = total - args.vocab_size * args.dim if flavor == "phi-4-mini" else total
    assert card == pytest.approx(PUBLISHED[flavor], rel=0.01)


# config.json of Phi-3-mini-4k-instruct, Phi-3-medium-4k-instruct and Phi-4 as published (auto_map of the first two
# left out: it names the remote code, which transformers' own Phi3 replaces).
_PHI3 = {"architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "embd_pdrop": 0.0,
         "eos_token_id": 32000, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 4096,
         "model_type": "phi3", "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
         "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "attention_bias": False,
         "vocab_size": 32064}
RELEASED = {
    "mini-4k": {**_PHI3, "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                                      "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
                "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 32,
                "num_key_value_heads": 32, "transformers_version": "4.40.2"},
    "medium-4k": {**_PHI3, "hidden_size": 5120, "intermediate_size": 17920, "num_attention_heads": 40,
                  "num_hidden_layers": 40, "num_key_value_heads": 10, "transformers_version": "4.39.3"},
    "phi-4": {"architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 100257, "embd_pdrop": 0.0, "eos_token_id": 100265, "hidden_act": "silu",
              "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17920,
              "max_position_embeddings": 16384, "model_type": "phi3", "num_attention_heads": 40,
              "num_hidden_layers": 40, "num_key_value_heads": 10, "original_max_position_embeddings": 16384,
              "pad_token_id": 100349, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None,
              "rope_theta": 250000, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "transformers_version": "4.47.0", "use_cache": True, "vocab_size": 100352},
}


@pytest.mark.parametrize("flavor", RELEASED)
def test_a_released_config_json_reads_as_its_preset(tmp_path, flavor):
    from titan_lightning.models.phi3 import phi3_args
    from titan_lightning.pretrained import check_folder_matches

    (tmp_path / "config.json").write_text(json.dumps(RELEASED[flavor]))
    assert read_hf_model(tmp_path).args == phi3_args(flavor)
    check_folder_matches(phi3_args(flavor), Phi3StateDictAdapter, tmp_path)
