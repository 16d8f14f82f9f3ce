"""Gemma 3 (text) <-> Hugging Face ``Gemma3ForCausalLM``: state dicts and config.json.

Llama's names plus QK-norm (permuted per head like Qwen 3's) and the four norms of a block:
``attention_norm`` / ``post_attention_norm`` / ``ffn_norm`` / ``post_ffn_norm`` are
``input_layernorm`` / ``post_attention_layernorm`` / ``pre_feedforward_layernorm`` /
``post_feedforward_layernorm``. The norm weights are Gemma's (the scale is ``1 + w``) on both
sides, so they copy as they are.

config.json: ``layer_types`` (or, in older files, every ``sliding_window_pattern``-th layer global)
and ``sliding_window`` become ``model.layer_types`` / ``model.sliding_window``; the RoPE bases come
from transformers 5's ``rope_parameters`` (one entry per layer type) or 4's ``rope_theta``,
``rope_local_base_freq`` and ``rope_scaling`` (linear, global layers only). Every released Gemma 3
ties its output to the embeddings, and a config.json without ``tie_word_embeddings`` means tied
(transformers' default for the family): the output starts as a copy of the embeddings, and an
export writes both, untied.

A multimodal ``gemma3`` folder (Gemma3ForConditionalGeneration: 4B, 12B, 27B as released) is read
for its language model: the args from ``text_config`` (with transformers' defaults for the shapes
its released files leave out), the weights under ``language_model.model.`` (or transformers 5's
``model.language_model.``); the vision tower and the projector are left out, said in one log line.
Its export is the text model alone, a ``gemma3_text`` folder; a LoRA run's PEFT adapter folder names
its targets as the multimodal model does (``wrapper_of``: lora/export.py), for PeftModel on that folder.
"""

import json
import logging
from pathlib import Path
from typing import Any, Optional

from titan_lightning.config import ConfigError
from titan_lightning.models.common.hf_checkpoint import HALF_ROTATED, LLAMA_BLOCK_KEYS, StateDictAdapter
from titan_lightning.models.common.hf_config import REQUIRED, HFConfig, decoder_fields, read_json_object
from titan_lightning.models.common.safetensors_io import HFTensors
from titan_lightning.models.gemma3.model import Gemma3Args, gemma3_layer_types

# config.json fields that must hold the one value implemented here (None: attention logits not
# soft-capped, Gemma 2's; causal attention, not EmbeddingGemma's bidirectional one).
FIXED_FIELDS = {"hidden_activation": "gelu_pytorch_tanh", "attention_dropout": 0.0, "attention_bias": False,
                "attn_logit_softcapping": None, "use_bidirectional_attention": False}
_NORMS = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
          "post_attention_norm.weight": "post_attention_layernorm.weight",
          "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
          "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}
_LAYER_TYPES = ("full_attention", "sliding_attention")
# A multimodal config.json's fields of the vision side (nothing of the text model), and the shapes
# Gemma3TextConfig defaults to (a released text_config lists only those that differ).
_VISION_FIELDS = ("vision_config", "mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index",
                  "boi_token_id", "eoi_token_id", "image_token_id")
_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                  "num_attention_heads": 8, "num_key_value_heads": 4}
# The language model's weights in a multimodal checkpoint (as released; as transformers 5 names them).
_TEXT_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                  "model.language_model.": "model."}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

log = logging.getLogger(__name__)


class Gemma3StateDictAdapter(StateDictAdapter):
    """Our Gemma 3 state dict <-> a Hugging Face Gemma3ForCausalLM one."""

    family = "Gemma3"
    layer_keys = {**LLAMA_BLOCK_KEYS, **_NORMS}
    rope_halves = HALF_ROTATED
    hf_model_types = ("gemma3_text", "gemma3")
    ties_by_default = True
    args_class, architecture = Gemma3Args, "Gemma3ForCausalLM"
    fixed_fields = FIXED_FIELDS
    wrapper_prefixes, wrapper_others = _TEXT_PREFIXES, _VISION_PREFIXES

    @classmethod
    def wrapper_of(cls, folder: Optional[str]) -> Optional[tuple[str, str]]:
        """A multimodal folder's Gemma3ForConditionalGeneration holds the text model's layers under
        ``model.language_model.`` (transformers 5's names, as PEFT's adapters on it name them)."""
        config = Path(folder or "") / "config.json"
        if folder is None or not config.is_file():
            return None
        return ("model.", "model.language_model.") if read_json_object(config).get("model_type") == "gemma3" else None

    @classmethod
    def args_from_hf_config(cls, config: HFConfig) -> Gemma3Args:
        if config.get("model_type") != "gemma3":
            return super().args_from_hf_config(config)
        config.ignore(*_VISION_FIELDS)
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{config.source}: text_config={json.dumps(text)}: expected an object")
        reader = HFConfig({**_TEXT_DEFAULTS, **text}, f"{config.source} text_config", config.family)
        reader.expect("model_type", "gemma3_text")
        args = super().args_from_hf_config(reader)
        reader.finish()
        log.info("%s: a multimodal gemma3 model; its text model is read (text_config, the language_model "
                 "weights), the vision tower and projector are left out", config.source)
        return args

    @classmethod
    def read_fields(cls, config: HFConfig) -> dict[str, Any]:
        """A Gemma3TextConfig's fields, with its defaults where a released file leaves them out."""
        config.ignore("cache_implementation")  # generation's KV cache ("hybrid"): nothing trained
        fields = decoder_fields(config, n_kv_heads=REQUIRED, head_dim=256, norm_eps=1e-6, max_seq_len=131072)
        window, layer_types = _layer_types(config, fields["n_layers"])
        return {**fields, **cls.read_rope(config), "sliding_window": window, "layer_types": layer_types,
                "query_pre_attn_scalar": config.get("query_pre_attn_scalar", default=256),
                "final_logit_softcapping": config.get("final_logit_softcapping", default=None)}

    @classmethod
    def read_rope(cls, config: HFConfig) -> dict[str, Any]:
        """The global base and linear factor, the local base: from ``rope_parameters`` (per layer type)
        or ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
        params = config.get("rope_parameters", default=None)
        if params is None:
            factor = _linear_factor(config, "rope_scaling", dict(config.get("rope_scaling", default=None) or {}))
            return {"rope_theta": float(config.get("rope_theta", default=1e6)), "rope_factor": factor,
                    "rope_local_theta": float(config.get("rope_local_base_freq", default=1e4))}
        config.ignore("rope_theta", "rope_scaling", "rope_local_base_freq")
        if not isinstance(params, dict) or set(params) - set(_LAYER_TYPES):
            raise ConfigError(f"{config.source}: rope_parameters={json.dumps(params)}: expected an object with "
                              f"\"full_attention\" and \"sliding_attention\" entries")
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
        theta, local_theta = full.pop("rope_theta", 1e6), local.pop("rope_theta", 1e4)
        factor = _linear_factor(config, "rope_parameters.full_attention", full)
        if _linear_factor(config, "rope_parameters.sliding_attention", local) != 1.0:
            raise ConfigError(f"{config.source}: rope_parameters.sliding_attention="
                              f"{json.dumps(params['sliding_attention'])}: scaled RoPE on the sliding layers is not "
                              f"modelled for Gemma3 here (supported: default)")
        return {"rope_theta": float(theta), "rope_factor": factor, "rope_local_theta": float(local_theta)}

    def sources(self, tensors: HFTensors) -> dict:
        """The language model's tensors, under Gemma3ForCausalLM's names (a multimodal checkpoint's
        vision tower and projector left out)."""
        return super().sources(_text_model(tensors))

    @classmethod
    def write_rope(cls, args: Gemma3Args) -> dict[str, Any]:
        full = {"rope_type": "default", "rope_theta": args.rope_theta}
        if args.rope_factor != 1.0:
            full = {"rope_type": "linear", "factor": args.rope_factor, "rope_theta": args.rope_theta}
        return {"rope_parameters": {"full_attention": full,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": args.rope_local_theta}}}

    @classmethod
    def write_fields(cls, args: Gemma3Args) -> dict[str, Any]:
        types = args.layer_types or ["sliding_attention" if args.sliding_window else "full_attention"] * args.n_layers
        return {"query_pre_attn_scalar": args.query_pre_attn_scalar,
                "final_logit_softcapping": args.final_logit_softcapping, "sliding_window": args.sliding_window,
                "layer_types": list(types), "tie_word_embeddings": False}  # (tied by default)


def _text_model(tensors: HFTensors) -> HFTensors:
    """``tensors`` with a multimodal checkpoint's language-model names made Gemma3ForCausalLM's and
    its vision tensors left out (a text checkpoint as it is)."""
    names = {}
    for key in tensors.keys():
        name = Gemma3StateDictAdapter.unwrapped(key)
        if name is not None:
            names[name] = key
    if all(ours == key for ours, key in names.items()) and len(names) == len(tensors.keys()):
        return tensors
    return HFTensors({ours: tensors.shape(key) for ours, key in names.items()},
                     lambda name, index: tensors.read(names[name], index))


def _layer_types(config: HFConfig, n_layers: int) -> tuple[Any, list[str]]:
    """(sliding_window, layer_types): config.json's list, or transformers' rule from the pattern."""
    window = config.get("sliding_window", default=4096)
    pattern = config.get("sliding_window_pattern", "_sliding_window_pattern", default=6)
    types = config.get("layer_types", default=None)
    if types is None:
        if not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(f"{config.source}: sliding_window_pattern={json.dumps(pattern)}: expected a positive "
                              f"integer")
        types = gemma3_layer_types(n_layers, pattern)
    if not isinstance(types, list) or len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        raise ConfigError(f"{config.source}: layer_types={json.dumps(types)}: expected one of \"full_attention\", "
                          f"\"sliding_attention\" for each of the {n_layers} layers")
    if "sliding_attention" in types and window is None:
        raise ConfigError(f"{config.source}: layer_types has sliding layers but sliding_window=null")
    return window, list(types)


def _linear_factor(config: HFConfig, where: str, scaling: dict[str, Any]) -> float:
    """The factor of a "linear" RoPE scaling dict (1.0 for "default" or none); anything else refused."""
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    factor = scaling.pop("factor", 1.0) if kind == "linear" else 1.0
    if kind not in ("default", "linear") or scaling or not (isinstance(factor, (int, float)) and factor > 0):
        raise ConfigError(f"{config.source}: {where} rope_type={json.dumps(kind)} with {json.dumps(scaling)}, factor="
                          f"{json.dumps(factor)} is not supported by Gemma3 here (supported: \"default\", "
                          f"\"linear\" with a positive factor)")
    return float(factor)
