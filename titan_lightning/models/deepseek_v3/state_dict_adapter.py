"""Hugging Face DeepSeek V3 checkpoints <-> our state dict.

Names map one to one, the routed experts stacked (models/common/hf_checkpoint.py has the layouts).
transformers 5 holds them fused in memory (``mlp.experts.gate_up_proj`` [E, 2 * hidden, dim], gate
rows first, and ``mlp.experts.down_proj``); ``from_hf`` reads that layout too, ``to_hf`` writes the
per-expert one of the published checkpoints.

RoPE needs no permutation: DeepSeek's checkpoints rotate adjacent feature pairs, as
models/common/rope.py does (transformers' ``rope_interleave=True``, its default, de-interleaves
q and k the same way before rotating halves, which leaves every q.k product unchanged).

Layers at or past ``n_layers`` (the 671B checkpoint's multi-token-prediction layer 61) are
skipped. FP8 checkpoints (``weight_scale_inv`` tensors) must be dequantized first.
"""

from typing import Any

from titan_lightning.models.common.hf_checkpoint import BLOCK_KEYS, EXPERT_KEYS, StateDictAdapter
from titan_lightning.models.deepseek_v3.model import DeepSeekV3Args


class DeepSeekV3StateDictAdapter(StateDictAdapter):
    """Converts between ``Transformer(args)`` state dicts and Hugging Face DeepseekV3ForCausalLM ones."""

    family = "DeepSeek V3"
    layer_keys = {
        **BLOCK_KEYS,
        "attention.wq_a.weight": "self_attn.q_a_proj.weight",
        "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attention.wq_b.weight": "self_attn.q_b_proj.weight",
        "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "moe.router.gate.weight": "mlp.gate.weight",
        "moe.expert_bias": "mlp.gate.e_score_correction_bias",
        "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
        "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
        "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    }
    expert_keys = EXPERT_KEYS
    extra_from_hf = {
        "mlp.experts.gate_up_proj": lambda t: dict(zip(("moe.experts.w1", "moe.experts.w3"), t.chunk(2, dim=1))),
        "mlp.experts.down_proj": lambda t: {"moe.experts.w2": t},
    }
    ignored_hf_suffixes = ("rotary_emb.inv_freq",)
    ignores_layers_past_n_layers = True


def to_hf_config(args: DeepSeekV3Args) -> dict[str, Any]:
    """``transformers.DeepseekV3Config`` keyword arguments describing ``Transformer(args)``.

    The router has no expert groups (``n_group=1, topk_group=1``; see presets.py) and always
    scores with a sigmoid in transformers, so only ``moe.score_func="sigmoid"`` models convert.
    With YaRN, transformers takes the factor as ``max_position_embeddings /
    original_max_position_embeddings``, so ``max_position_embeddings`` is the stretched length
    (163,840 for the published checkpoints), not ``max_seq_len``.
    """
    if args.moe.score_func != "sigmoid":
        raise ValueError(
            f"model.moe.score_func={args.moe.score_func!r}: Hugging Face DeepSeek V3 routes with 'sigmoid' only"
        )
    m = args.moe
    rope_scaling, max_positions = None, args.max_seq_len
    if args.uses_yarn:
        max_positions = round(args.rope_factor * args.original_seq_len)
        rope_scaling = {
            "rope_type": "yarn", "factor": args.rope_factor, "original_max_position_embeddings": args.original_seq_len,
            "beta_fast": args.beta_fast, "beta_slow": args.beta_slow, "mscale": args.mscale,
            "mscale_all_dim": args.mscale,
        }  # fmt: skip
    return dict(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.inter_dim,
        moe_intermediate_size=m.hidden_dim, num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_heads, n_shared_experts=m.num_shared_experts, n_routed_experts=m.num_experts,
        routed_scaling_factor=m.route_scale, kv_lora_rank=args.kv_lora_rank, q_lora_rank=args.q_lora_rank or None,
        qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim, qk_nope_head_dim=args.qk_nope_head_dim,
        n_group=1, topk_group=1, num_experts_per_tok=m.top_k, first_k_dense_replace=args.n_dense_layers,
        norm_topk_prob=m.route_norm, max_position_embeddings=max_positions, rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta, rope_scaling=rope_scaling, rope_interleave=True,
        tie_word_embeddings=False, attention_bias=False,
    )  # fmt: skip
