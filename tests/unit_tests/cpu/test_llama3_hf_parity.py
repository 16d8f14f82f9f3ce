"""A Hugging Face Llama checkpoint, loaded through our adapter, gives the same logits as
``transformers`` computes from it (fp32, random weights, tiny shapes, Llama 3.1 RoPE scaling);
and our own checkpoint loads into transformers. Skipped where transformers is absent (CI);
run on the GPU machine, which has it."""

import inspect

import pytest
import torch

from test_qwen3_model import randomized
from titan_lightning.models.llama3 import Llama3Args, Llama3StateDictAdapter, RopeScaling, Transformer

transformers = pytest.importorskip("transformers", reason="the reference implementation; not a project dependency")

THETA = 500000.0
SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)


def config(tie_word_embeddings: bool = False):
    rope = {"rope_type": "llama3", **SCALING}
    if "rope_parameters" in inspect.signature(transformers.LlamaConfig).parameters:  # transformers 5
        rope_kwargs = {"rope_parameters": {**rope, "rope_theta": THETA}}
    else:
        rope_kwargs = {"rope_theta": THETA, "rope_scaling": rope}
    return transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, attention_bias=False,
        mlp_bias=False, tie_word_embeddings=tie_word_embeddings, **rope_kwargs,
    )


def our_args(c) -> Llama3Args:
    # ffn_hidden_dim = multiple_of * ceil(8/3 * dim / multiple_of) = 192 for dim 64, multiple_of 64
    args = Llama3Args(vocab_size=c.vocab_size, dim=c.hidden_size, n_layers=c.num_hidden_layers,
                      n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads, multiple_of=64,
                      norm_eps=c.rms_norm_eps, rope_theta=THETA, rope_scaling=RopeScaling(**SCALING),
                      max_seq_len=c.max_position_embeddings)
    assert args.ffn_hidden_dim == c.intermediate_size
    return args


def save(model, folder) -> None:
    kwargs = {"safe_serialization": True} if "safe_serialization" in inspect.signature(model.save_pretrained).parameters else {}
    model.save_pretrained(folder, **kwargs)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tmp_path, tie):
    c = config(tie)
    torch.manual_seed(0)
    reference = randomized(transformers.LlamaForCausalLM(c).float().eval())
    save(reference, tmp_path)
    tokens = torch.randint(0, c.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))  # past 16: scaled RoPE
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
    assert expected.std() > 0.5
    model = Transformer(our_args(c))
    model.init_weights(seed=1)  # overwritten by the load
    Llama3StateDictAdapter(model.args, tie_word_embeddings=tie).load_into(model, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)


def test_our_checkpoint_loads_into_transformers(tmp_path):
    c = config()
    model = Transformer(our_args(c))
    model.init_weights(seed=3)
    Llama3StateDictAdapter(model.args).save_from(model, tmp_path, max_shard_bytes=100_000)
    c.save_pretrained(tmp_path)
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path).float().eval()
    tokens = torch.randint(0, c.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
