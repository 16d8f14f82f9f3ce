"""Phi-3 / Phi-4 <-> Hugging Face ``Phi3ForCausalLM``: state dicts and config.json.

Llama's names, but Hugging Face holds q, k and v as one ``self_attn.qkv_proj`` ([q; k; v] rows)
and the SwiGLU's gate and up as one ``mlp.gate_up_proj`` ([gate; up]). ``sources`` reads each
part as a tensor of its own (``qkv_proj.weight[q]`` ...: a rank reads only the rows of its block),
``to_hf`` fuses them again; an export hands it a layer's parts together (``export_group``).

config.json: ``sliding_window`` (Phi-3-mini-4k's 2047) is ``model.sliding_window`` on every layer
as transformers applies it; ``partial_rotary_factor`` and LongRoPE (``longrope`` / ``su``) are
``model.rotary_dim`` and ``model.rope_scaling`` (models/phi3/model.py); the dropouts must be 0.
"""

import json
import re
from typing import Any

import torch
from torch import Tensor

from titan_lightning.config import ConfigError
from titan_lightning.models.common.hf_checkpoint import HALF_ROTATED, LLAMA_BLOCK_KEYS, StateDictAdapter
from titan_lightning.models.common.hf_config import (HFConfig, decoder_fields, sliding_window_fields,
                                                     uniform_sliding_window)
from titan_lightning.models.common.safetensors_io import HFTensors
from titan_lightning.models.phi3.model import LongRope, Phi3Args, longrope_attention_factor

# Hugging Face's fused tensors -> their parts, in row order, as our keys name them.
FUSED = {"self_attn.qkv_proj.weight": ("q", "k", "v"), "mlp.gate_up_proj.weight": ("gate", "up")}
_PARTS = {"attention.wq.weight": "self_attn.qkv_proj.weight[q]", "attention.wk.weight": "self_attn.qkv_proj.weight[k]",
          "attention.wv.weight": "self_attn.qkv_proj.weight[v]",
          "feed_forward.w1.weight": "mlp.gate_up_proj.weight[gate]",
          "feed_forward.w3.weight": "mlp.gate_up_proj.weight[up]"}
_GROUP = re.compile(r"(layers\.\d+\.)(?:attention\.w[qkv]|feed_forward\.w[13])\.weight")
_LONGROPE_FIELDS = ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor", "factor",
                    "partial_rotary_factor")


class Phi3StateDictAdapter(StateDictAdapter):
    """Our Phi-3 state dict <-> a Hugging Face Phi3 one. ``tie_word_embeddings``: Phi-4-mini ties
    ``lm_head`` to the embeddings."""

    family = "Phi3"
    layer_keys = {**LLAMA_BLOCK_KEYS, **_PARTS}
    rope_halves = HALF_ROTATED
    hf_model_types = ("phi3",)
    args_class, architecture = Phi3Args, "Phi3ForCausalLM"
    fixed_fields = {"hidden_act": "silu", "attention_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                    "attention_bias": False}

    def _part_rows(self) -> dict[str, tuple[int, ...]]:
        a = self.args
        q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        return {"self_attn.qkv_proj.weight": (q, kv, kv), "mlp.gate_up_proj.weight": (a.ffn_hidden_dim,) * 2}

    def sources(self, tensors: HFTensors) -> dict:
        return super().sources(self._split(tensors))

    def _split(self, tensors: HFTensors) -> HFTensors:
        """``tensors`` with each fused tensor replaced by its parts (``...qkv_proj.weight[q]`` ...)."""
        shapes: dict[str, tuple[int, ...]] = {}
        parts: dict[str, tuple[str, int]] = {}  # part -> (fused key, first row)
        rows = self._part_rows()
        for key in tensors.keys():
            fused = next((f for f in FUSED if key.endswith("." + f)), None)
            if fused is None:
                shapes[key] = tensors.shape(key)
                continue
            shape = tensors.shape(key)
            if shape[0] != sum(rows[fused]):
                raise ValueError(f"{fused.split('.')[-2]} shape {list(shape)} for {key} expected "
                                 f"{[sum(rows[fused]), *shape[1:]]} ({' + '.join(map(str, rows[fused]))} rows: "
                                 f"{', '.join(FUSED[fused])})")
            first = 0
            for name, n in zip(FUSED[fused], rows[fused]):
                shapes[f"{key}[{name}]"], parts[f"{key}[{name}]"] = (n, *shape[1:]), (key, first)
                first += n

        def read(name: str, index: tuple[slice, ...]) -> Tensor:
            if name not in parts:
                return tensors.read(name, index)
            key, first = parts[name]
            start, stop, _ = (index[0] if index else slice(None)).indices(shapes[name][0])
            return tensors.read(key, (slice(first + start, first + stop), *index[1:]))

        return HFTensors(shapes, read)

    def export_group(self, ours: str) -> str:
        match = _GROUP.fullmatch(ours)
        return ours if match is None else match[1] + ("qkv" if "attention" in ours else "gate_up")

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        hf = super().to_hf(state_dict)
        for fused in dict.fromkeys(k[:k.index("[")] for k in hf if k.endswith("]")):
            names = [f"{fused}[{part}]" for part in FUSED[fused.split(".", 3)[3]]]
            missing = [n for n in names if n not in hf]
            if missing:
                raise ValueError(f"{fused} fuses {', '.join(names)}; {', '.join(missing)} not given (convert a "
                                 f"layer's parts together: export_group)")
            hf[fused] = torch.cat([hf.pop(n) for n in names])
        return hf

    def permute_heads(self, w: Tensor, head_dim: int, *, to_hf: bool) -> Tensor:
        """Only the first ``rotated`` rows of each head (partial rotation): the rest pass RoPE by."""
        rotated = self.args.rotated
        if rotated == head_dim:
            return super().permute_heads(w, head_dim, to_hf=to_hf)
        heads = w.reshape(-1, head_dim, *w.shape[1:])
        turned = super().permute_heads(heads[:, :rotated].reshape(-1, *w.shape[1:]), rotated, to_hf=to_hf)
        return torch.cat((turned.reshape(-1, rotated, *w.shape[1:]), heads[:, rotated:]), dim=1).reshape(w.shape)

    @classmethod
    def check_config(cls, job: Any) -> None:
        """Besides the export's rules: LongRoPE's factor set is the one transformers turns sequences of
        ``training.seq_len`` tokens with, so the trained model is the one it runs."""
        super().check_config(job)
        s, seq_len = job.model.rope_scaling, job.training.seq_len
        if s is None:
            return
        wanted = "long" if seq_len > s.original_max_position_embeddings else "short"
        if s.factors != wanted:
            raise ConfigError(f"model.rope_scaling.factors={s.factors!r} with training.seq_len={seq_len}: transformers "
                              f"turns sequences of {seq_len} tokens with the {wanted} factors (long past "
                              f"original_max_position_embeddings={s.original_max_position_embeddings}); set "
                              f"model.rope_scaling.factors={wanted!r}")
        if wanted == "long" and job.model.positions == "per_document":
            raise ConfigError(f"model.positions='per_document' with the long LongRoPE factors: transformers picks the "
                              f"set by each batch's longest document, which a run cannot fix; use positions='global' "
                              f"or training.seq_len <= {s.original_max_position_embeddings}")

    @classmethod
    def read_fields(cls, config: HFConfig) -> dict[str, Any]:
        # The early checkpoints' remote code (trust_remote_code); transformers' own Phi3 is the model read here.
        config.ignore("auto_map")
        window, _ = sliding_window_fields(config, per_layer=False)
        params = config.values.get("rope_parameters")
        partial = config.get("partial_rotary_factor", default=1.0)
        if isinstance(params, dict):  # transformers 5 keeps its copy there; that one wins, as in transformers
            partial = params.get("partial_rotary_factor", partial)
            _check_legacy_rope_scaling(params, config.values.get("rope_scaling"), config.source)
        theta, scaling = config.rope()
        fields = decoder_fields(config)
        rotated = int(fields["head_dim"] * partial)
        original = config.get("original_max_position_embeddings", default=4096)  # used by LongRoPE only
        return {**fields, "rotary_dim": None if rotated == fields["head_dim"] else rotated, "rope_theta": theta,
                "rope_scaling": None if scaling is None else _longrope(scaling, original, fields["max_seq_len"],
                                                                       config.source),
                "sliding_window": window}

    @classmethod
    def check_expressible(cls, args: Phi3Args) -> None:
        uniform_sliding_window(args, "Hugging Face Phi3 applies")

    @classmethod
    def write_rope(cls, args: Phi3Args) -> dict[str, Any]:
        s = args.rope_scaling
        original = args.max_seq_len if s is None else s.original_max_position_embeddings
        return {"original_max_position_embeddings": original,
                "partial_rotary_factor": args.rotated / args.head_dim, "rope_theta": args.rope_theta,
                "rope_scaling": None if s is None else {"rope_type": "longrope", "short_factor": s.short_factor,
                                                        "long_factor": s.long_factor,
                                                        "attention_factor": s.attention_factor}}

    @classmethod
    def write_fields(cls, args: Phi3Args) -> dict[str, Any]:
        # pad_token_id: transformers' Phi3Config defaults it to 32000, which must index the vocabulary; a
        # padding_idx changes no logits (it keeps that row's gradient at zero in transformers' training).
        return {"sliding_window": uniform_sliding_window(args, "Hugging Face Phi3 applies"), "pad_token_id": None}


def _check_legacy_rope_scaling(params: dict[str, Any], legacy: Any, source: str) -> None:
    """A legacy ``rope_scaling`` next to ``rope_parameters``: transformers builds Phi3's RoPE from the legacy
    one (and refuses any but LongRoPE), so a scaling that differs from rope_parameters' is refused by name."""
    if not isinstance(legacy, dict) or not legacy:
        return

    def kind(scaling: dict[str, Any]) -> str:
        return scaling.get("rope_type", scaling.get("type", "default"))

    def fields(scaling: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in scaling.items()
                if k not in ("type", "rope_type", "rope_theta", "partial_rotary_factor")}

    if kind(legacy) == kind(params) and all(params.get(k) == v for k, v in fields(legacy).items()):
        return  # the same scaling twice
    supported = kind(legacy) in ("default", "longrope", "su")
    refusal = "over rope_parameters" if supported else "and refuses it: Phi3 takes default or longrope RoPE"
    raise ConfigError(f"{source}: rope_scaling={json.dumps(legacy)} next to rope_parameters={json.dumps(params)}: "
                      f"transformers reads the legacy rope_scaling ({kind(legacy)}) {refusal}; keep one of the two")


def _longrope(scaling: dict[str, Any], original: int, max_seq_len: int, source: str) -> LongRope:
    """``model.rope_scaling`` of a config.json's LongRoPE dict (``su`` is its older name)."""
    kind = scaling.get("rope_type")
    if kind not in ("longrope", "su"):
        raise ConfigError(f"{source}: rope_type={json.dumps(kind)} is not supported by Phi3 here (supported: "
                          f"\"default\", \"longrope\", \"su\")")
    extra = sorted(set(scaling) - set(_LONGROPE_FIELDS) - {"rope_type"})
    if extra:
        raise ConfigError(f"{source}: longrope RoPE field(s) {', '.join(extra)} not modelled for Phi3 here")
    missing = [f for f in ("short_factor", "long_factor") if f not in scaling]
    if missing:
        raise ConfigError(f"{source}: longrope RoPE needs {', '.join(missing)}")
    theirs = scaling.get("original_max_position_embeddings", original)
    if theirs != original:  # transformers' Phi3 takes the top-level one
        raise ConfigError(f"{source}: rope_scaling.original_max_position_embeddings={theirs} differs from "
                          f"original_max_position_embeddings={original}")
    factor = scaling.get("attention_factor")
    if factor is None:
        factor = longrope_attention_factor(max_seq_len, original, scaling.get("factor"))
    return LongRope(short_factor=[float(f) for f in scaling["short_factor"]],
                    long_factor=[float(f) for f in scaling["long_factor"]],
                    original_max_position_embeddings=original, attention_factor=float(factor))
