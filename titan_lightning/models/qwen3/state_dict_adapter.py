"""Qwen 3 <-> Hugging Face ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` state dicts.

    ours                                  Hugging Face
    tok_embeddings.weight                 model.embed_tokens.weight
    layers.N.attention_norm.weight        model.layers.N.input_layernorm.weight
    layers.N.attention.wq/wk/wv/wo        model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj
    layers.N.attention.q_norm/k_norm      model.layers.N.self_attn.q_norm/k_norm
    layers.N.ffn_norm.weight              model.layers.N.post_attention_layernorm.weight
    layers.N.feed_forward.w1/w3/w2        model.layers.N.mlp.gate_proj/up_proj/down_proj
    layers.N.moe.router.gate.weight       model.layers.N.mlp.gate.weight
    layers.N.moe.experts.w1/w3/w2 [E,..]  model.layers.N.mlp.experts.J.gate_proj/up_proj/down_proj.weight
    norm.weight                           model.norm.weight
    output.weight                         lm_head.weight

RoPE: ours rotates adjacent feature pairs (2i, 2i+1) of a head (models/common/rope.py),
Hugging Face rotates feature i with i + head_dim/2 ("rotate_half"). The rows of q_proj and
k_proj, and the q_norm/k_norm weights (QK-norm runs before RoPE, feature by feature), are
permuted within each head: HF feature c * head_dim/2 + i is our feature 2i + c. Values,
o_proj and everything else keep their layout.

``moe.expert_bias`` (auxiliary-loss-free load balancing) has no Hugging Face counterpart:
``to_hf`` drops it (with a warning if it is not zero: the HF model will route differently)
and ``from_hf`` starts it at zero.
"""

import re
import warnings

import torch
from torch import Tensor

from titan_lightning.models.common.hf_checkpoint import StateDictAdapter
from titan_lightning.models.qwen3.model import Qwen3Args

# Our name inside a block -> Hugging Face's name inside ``model.layers.N``.
_LAYER_KEYS = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
}
_TOP_KEYS = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
# Stacked expert weights -> the per-expert Hugging Face projection.
_EXPERT_KEYS = {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj", "moe.experts.w2": "down_proj"}
_EXPERT_BIAS = "moe.expert_bias"

_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _halves_to_pairs(w: Tensor, n_heads: int) -> Tensor:
    """Rows (or entries) per head from Hugging Face's rotate-half order to adjacent pairs."""
    return w.reshape(n_heads, 2, -1, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _pairs_to_halves(w: Tensor, n_heads: int) -> Tensor:
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class Qwen3StateDictAdapter(StateDictAdapter):
    """Our Qwen 3 state dict <-> a Hugging Face Qwen3 / Qwen3-MoE one (see the module docstring).

    ``tie_word_embeddings``: the Hugging Face model ties ``lm_head`` to the embeddings (0.6B,
    1.7B, 4B) and its checkpoint has no ``lm_head.weight``; ``from_hf`` copies the embeddings
    into our untied output, and ``to_hf`` refuses an output that no longer equals them.
    """

    family = "Qwen3"
    # Our name inside a block -> Hugging Face's inside model.layers.N; stacked experts -> projection.
    layer_keys = _LAYER_KEYS
    expert_keys = _EXPERT_KEYS

    def __init__(self, args: Qwen3Args, *, tie_word_embeddings: bool = False):
        self.args = args
        self.tie_word_embeddings = tie_word_embeddings
        if args.moe is not None and args.moe.num_shared_experts:
            raise ValueError(
                f"model.moe.num_shared_experts={args.moe.num_shared_experts}: Hugging Face Qwen3-MoE has no "
                f"shared experts; use 0"
            )

    def _head_counts(self) -> dict[str, int]:
        """Our layer keys whose features are permuted per head, with their head counts."""
        a = self.args
        return {"attention.wq.weight": a.n_heads, "attention.wk.weight": a.n_kv_heads,
                "attention.q_norm.weight": 1, "attention.k_norm.weight": 1}

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        heads = self._head_counts()
        hf: dict[str, Tensor] = {}
        unknown = []
        for key, value in state_dict.items():
            if key in _TOP_KEYS:
                hf[_TOP_KEYS[key]] = value
                continue
            match = _OUR_LAYER.fullmatch(key)
            layer, name = match.groups() if match else (None, key)
            prefix = f"model.layers.{layer}."
            if layer is not None and name in self.layer_keys:
                hf[prefix + self.layer_keys[name]] = _pairs_to_halves(value, heads[name]) if name in heads else value
            elif layer is not None and name in self.expert_keys:
                for j, expert in enumerate(value.unbind(0)):
                    hf[f"{prefix}mlp.experts.{j}.{self.expert_keys[name]}.weight"] = expert
            elif layer is not None and name == _EXPERT_BIAS:
                if value.any():
                    warnings.warn(f"{key} is not zero; Hugging Face Qwen3-MoE has no expert bias, it is dropped")
            else:
                unknown.append(key)
        if unknown:
            raise ValueError(f"no Hugging Face {self.family} name for {', '.join(unknown)}")
        if self.tie_word_embeddings:
            output = hf.pop("lm_head.weight")
            if not torch.equal(output, hf["model.embed_tokens.weight"]):
                raise ValueError(
                    "tie_word_embeddings=True, but output.weight differs from tok_embeddings.weight; "
                    "save with tie_word_embeddings=False"
                )
        return hf

    def from_hf(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        top = {hf_key: ours for ours, hf_key in _TOP_KEYS.items()}
        layer_keys = {hf_key: ours for ours, hf_key in self.layer_keys.items()}
        expert_keys = {proj: ours for ours, proj in self.expert_keys.items()}
        heads = self._head_counts()
        sd: dict[str, Tensor] = {}
        experts: dict[str, dict[int, Tensor]] = {}  # our stacked key -> expert index -> weight
        unknown = []
        for key, value in hf_state_dict.items():
            if key in top:
                sd[top[key]] = value
                continue
            match = _HF_LAYER.fullmatch(key)
            layer, name = match.groups() if match else (None, key)
            expert = _HF_EXPERT.fullmatch(name) if layer is not None else None
            if layer is not None and name in layer_keys:
                ours = layer_keys[name]
                sd[f"layers.{layer}.{ours}"] = _halves_to_pairs(value, heads[ours]) if ours in heads else value
            elif expert is not None:
                experts.setdefault(f"layers.{layer}.{expert_keys[expert.group(2)]}", {})[int(expert.group(1))] = value
            else:
                unknown.append(key)
        if unknown:
            raise ValueError(f"no {self.family} name for Hugging Face keys {', '.join(unknown)}")
        for key, by_index in experts.items():
            moe = getattr(self.args, "moe", None)
            n = len(by_index) if moe is None else moe.num_experts
            absent = sorted(set(range(n)) - by_index.keys())
            if absent or len(by_index) != n:
                raise ValueError(f"{key}: Hugging Face experts {absent or sorted(by_index)} missing or extra "
                                 f"(expected 0..{n - 1})")
            sd[key] = torch.stack([by_index[j] for j in range(n)])
        if self.tie_word_embeddings and "output.weight" not in sd and "tok_embeddings.weight" in sd:
            sd["output.weight"] = sd["tok_embeddings.weight"].clone()
        moe = getattr(self.args, "moe", None)
        if moe is not None and moe.load_balance_coeff is not None:
            for layer in range(self.args.n_layers):
                sd[f"layers.{layer}.{_EXPERT_BIAS}"] = torch.zeros(moe.num_experts, dtype=torch.float32)
        return sd
