"""Hugging Face DeepSeek V3 checkpoints <-> our state dict.

Names map one to one, except the routed experts: Hugging Face keeps one Linear per expert
(``mlp.experts.J.{gate,up,down}_proj.weight``), we stack them (``moe.experts.w1/w3/w2``
[E, ...]). transformers 5 holds them fused in memory (``mlp.experts.gate_up_proj``
[E, 2 * hidden, dim], gate rows first, and ``mlp.experts.down_proj``); ``from_hf`` reads
that layout too, ``to_hf`` writes the per-expert one of the published checkpoints.

RoPE needs no permutation: DeepSeek's checkpoints rotate adjacent feature pairs, as
models/common/rope.py does (transformers' ``rope_interleave=True``, its default, de-interleaves
q and k the same way before rotating halves, which leaves every q.k product unchanged).

Layers at or past ``n_layers`` (the 671B checkpoint's multi-token-prediction layer 61) are
skipped. FP8 checkpoints (``weight_scale_inv`` tensors) must be dequantized first.
"""

import re
from typing import Any

import torch

from titan_lightning.models.common.hf_checkpoint import StateDictAdapter
from titan_lightning.models.deepseek_v3.model import DeepSeekV3Args

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOP_FROM_HF = {hf: ours for ours, hf in _TOP.items()}

# Inside ``layers.N.`` -> inside ``model.layers.N.``.
_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_LAYER_FROM_HF = {hf: ours for ours, hf in _LAYER.items()}

# Stacked expert weight -> the per-expert Hugging Face projection.
_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERTS_FROM_HF = {hf: ours for ours, hf in _EXPERTS.items()}

_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class DeepSeekV3StateDictAdapter(StateDictAdapter):
    """Converts between ``Transformer(args)`` state dicts and Hugging Face DeepseekV3ForCausalLM ones."""

    def __init__(self, args: DeepSeekV3Args):
        self.args = args

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hf = {}
        for key, tensor in state_dict.items():
            if key in _TOP:
                hf[_TOP[key]] = tensor
                continue
            match = _OURS_LAYER.fullmatch(key)
            rest = match and match.group(2)
            if rest in _LAYER:
                hf[f"model.layers.{match.group(1)}.{_LAYER[rest]}"] = tensor
            elif rest and rest.startswith("moe.experts.") and rest[len("moe.experts."):] in _EXPERTS:
                projection = _EXPERTS[rest[len("moe.experts."):]]
                for j, weight in enumerate(tensor.unbind(0)):
                    hf[f"model.layers.{match.group(1)}.mlp.experts.{j}.{projection}.weight"] = weight
            else:
                raise ValueError(f"no Hugging Face name for DeepSeek V3 state-dict key {key!r}")
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ours: dict[str, torch.Tensor] = {}
        experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        unknown = []
        for key, tensor in hf_state_dict.items():
            if key in _TOP_FROM_HF:
                ours[_TOP_FROM_HF[key]] = tensor
                continue
            match = _HF_LAYER.fullmatch(key)
            if match is None:
                if not key.endswith("rotary_emb.inv_freq"):
                    unknown.append(key)
                continue
            layer, rest = int(match.group(1)), match.group(2)
            if layer >= self.args.n_layers:
                continue
            expert = _HF_EXPERT.fullmatch(rest)
            if rest in _LAYER_FROM_HF:
                ours[f"layers.{layer}.{_LAYER_FROM_HF[rest]}"] = tensor
            elif expert is not None:
                experts.setdefault((layer, _EXPERTS_FROM_HF[expert.group(2)]), {})[int(expert.group(1))] = tensor
            elif rest == "mlp.experts.gate_up_proj":
                ours[f"layers.{layer}.moe.experts.w1"], ours[f"layers.{layer}.moe.experts.w3"] = tensor.chunk(2, dim=1)
            elif rest == "mlp.experts.down_proj":
                ours[f"layers.{layer}.moe.experts.w2"] = tensor
            else:
                unknown.append(key)
        if unknown:
            raise ValueError(f"Hugging Face keys with no DeepSeek V3 equivalent: {', '.join(sorted(unknown)[:8])}")
        for (layer, name), per_expert in experts.items():
            ours[f"layers.{layer}.moe.experts.{name}"] = self._stack(layer, name, per_expert)
        return ours

    def _stack(self, layer: int, name: str, per_expert: dict[int, torch.Tensor]) -> torch.Tensor:
        expected = self.args.moe.num_experts
        if sorted(per_expert) != list(range(expected)):
            missing = sorted(set(range(expected)) - set(per_expert))
            raise ValueError(
                f"model.layers.{layer}.mlp.experts.*.{_EXPERTS[name]}: expected experts 0..{expected - 1} "
                f"(model.moe.num_experts={expected}), missing {missing[:8]}, got {len(per_expert)}"
            )
        return torch.stack([per_expert[j] for j in range(expected)])


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
