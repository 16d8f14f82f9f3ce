"""A Hugging Face Qwen3 / Qwen3-MoE checkpoint, loaded through our adapter, gives the same
logits as ``transformers`` computes from it (fp32, random weights, tiny shapes)."""

import inspect

import pytest
import torch

from titan_lightning.models.common.moe import MoEArgs
from test_qwen3_model import randomized
from titan_lightning.models.qwen3 import Qwen3Args, Qwen3StateDictAdapter, Transformer

transformers = pytest.importorskip("transformers", reason="the reference implementation; not a project dependency")

THETA = 1000000.0
SHAPES = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False)


def rope_kwargs(config_class) -> dict:
    """transformers 5 takes ``rope_parameters``; 4.x takes ``rope_theta``."""
    if "rope_parameters" in inspect.signature(config_class).parameters:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": THETA}}
    return {"rope_theta": THETA}


def dense_config(tie_word_embeddings: bool = False):
    # head_dim 32 != hidden_size / num_attention_heads = 16, as in the real Qwen 3 sizes.
    return transformers.Qwen3Config(
        hidden_size=64, intermediate_size=96, head_dim=32, tie_word_embeddings=tie_word_embeddings,
        **SHAPES, **rope_kwargs(transformers.Qwen3Config),
    )


def moe_config():
    # head_dim = hidden_size / num_attention_heads: not every transformers version has a head_dim field here.
    return transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        output_router_logits=False, **SHAPES, **rope_kwargs(transformers.Qwen3MoeConfig),
    )


def our_args(config, moe: bool) -> Qwen3Args:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Qwen3Args(
        vocab_size=config.vocab_size, dim=config.hidden_size, n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads, head_dim=head_dim,
        ffn_hidden_dim=config.intermediate_size, norm_eps=config.rms_norm_eps, rope_theta=THETA,
        max_seq_len=config.max_position_embeddings,
        moe=MoEArgs(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                    hidden_dim=config.moe_intermediate_size, score_func="softmax", route_norm=True,
                    load_balance_coeff=1e-3) if moe else None,
    )


def hf_model(model_class, config, seed: int = 0):
    """Random fp32 weights at a scale that gives O(1) logits, norm weights away from one."""
    torch.manual_seed(seed)
    model = randomized(model_class(config).float().eval(), seed)
    # The config really reached the model: RoPE frequencies of head_dim and THETA.
    rotary = next(m for n, m in model.named_modules() if n.endswith("rotary_emb"))
    head_dim = model.model.layers[0].self_attn.head_dim
    expected = 1.0 / THETA ** (torch.arange(0, head_dim, 2).float() / head_dim)
    torch.testing.assert_close(rotary.inv_freq.float(), expected)
    return model


def save(model, folder) -> None:
    kwargs = {}
    parameters = inspect.signature(model.save_pretrained).parameters
    if "safe_serialization" in parameters:
        kwargs["safe_serialization"] = True
    if "save_original_format" in parameters:  # transformers 5: per-expert keys, as on the Hub
        kwargs["save_original_format"] = True
    model.save_pretrained(folder, **kwargs)


def our_logits(args: Qwen3Args, folder, tokens, tie_word_embeddings: bool = False) -> torch.Tensor:
    model = Transformer(args)
    model.init_weights(seed=1)  # overwritten by the load
    Qwen3StateDictAdapter(args, tie_word_embeddings=tie_word_embeddings).load_into(model, folder)
    with torch.no_grad():
        return model(tokens)


def reference_logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_logits_match_transformers(tmp_path, moe):
    config = moe_config() if moe else dense_config()
    model_class = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    reference = hf_model(model_class, config)
    save(reference, tmp_path)
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = reference_logits(reference, tokens)
    assert expected.std() > 0.5
    torch.testing.assert_close(our_logits(our_args(config, moe), tmp_path, tokens), expected, rtol=1e-5, atol=1e-5)


def test_tied_checkpoint_matches_transformers(tmp_path):
    config = dense_config(tie_word_embeddings=True)
    reference = hf_model(transformers.Qwen3ForCausalLM, config)
    assert reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()
    save(reference, tmp_path)
    tokens = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    ours = our_logits(our_args(config, moe=False), tmp_path, tokens, tie_word_embeddings=True)
    torch.testing.assert_close(ours, reference_logits(reference, tokens), rtol=1e-5, atol=1e-5)


def test_our_checkpoint_loads_into_transformers(tmp_path):
    """The other direction: save_from writes a folder that transformers loads (with its config)."""
    config = moe_config()
    args = our_args(config, moe=True)
    model = Transformer(args)
    model.init_weights(seed=3)
    Qwen3StateDictAdapter(args).save_from(model, tmp_path, max_shard_bytes=100_000)
    config.save_pretrained(tmp_path)
    reference = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path).float().eval()
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(ours, reference_logits(reference, tokens), rtol=1e-5, atol=1e-5)
