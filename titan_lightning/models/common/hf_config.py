"""Hugging Face ``config.json`` <-> a model family's args, field by field.

Reading is strict, because wrong args load silently (most fields change no shape): every field
of config.json is either mapped to one of ours (``get``), required to hold the one value we
implement (``expect``: ``attention_bias: false``, ``hidden_act: silu`` ...), bookkeeping that
changes nothing the model computes (``BOOKKEEPING``: token ids, ``use_cache``, versions ...),
or refused by name when ``finish`` finds it unread. The fields every grouped-query family shares
are written once here (``DECODER_FIELDS``: ``decoder_fields`` reads them, ``config_of`` writes
them); the state-dict adapter's base class (models/common/hf_checkpoint.py) joins them to a family's
fixed fields and RoPE, and each family's adapter reads and writes only what differs.
"""

import json
from pathlib import Path
from typing import Any, Optional

from titan_lightning.config import ConfigError

CONFIG_FILE = "config.json"

# Fields that change nothing the model computes from its weights.
BOOKKEEPING = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "_name_or_path",
    "output_router_logits", "output_attentions", "output_hidden_states", "return_dict",
    "tie_word_embeddings",  # read by the adapter: the output starts as a copy of the embeddings
})
REQUIRED = object()  # a field config.json must hold (``get``'s default, ``decoder_fields``')
_DERIVED = object()
# Our DecoderArgs fields -> config.json's, the same in every grouped-query family (read and written as they are).
DECODER_FIELDS = {"vocab_size": "vocab_size", "dim": "hidden_size", "ffn_hidden_dim": "intermediate_size",
                  "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                  "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "norm_eps": "rms_norm_eps",
                  "max_seq_len": "max_position_embeddings"}


def read_config_json(folder: Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict; one-line errors for a missing or unreadable file."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{path}: no {CONFIG_FILE}; a Hugging Face model folder has one (save_pretrained writes it)")
    return read_json_object(path)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (config.json, generation_config.json); one-line errors otherwise."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{path}: not a JSON file ({' '.join(str(err).split())})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


class HFConfig:
    """The fields of one config.json, read one by one; ``finish`` refuses any left unread."""

    def __init__(self, config: dict[str, Any], source: str, family: str) -> None:
        self.values, self.source, self.family = dict(config), source, family
        self.read: set[str] = set()

    def _where(self, name: str) -> str:
        return f"{self.source}: {name}"

    def get(self, *names: str, default: Any = REQUIRED) -> Any:
        """The value of the first of ``names`` (aliases: ``num_experts``, ``num_local_experts``)
        config.json holds; ``default`` when none is there (no default: a one-line error)."""
        self.read.update(names)
        for name in names:
            if name in self.values:
                return self.values[name]
        if default is REQUIRED:
            raise ConfigError(f"{self._where(names[0])} is missing; {self.family} needs it")
        return default

    def expect(self, name: str, *supported: Any) -> None:
        """``name`` is absent or holds one of ``supported`` (the values this project implements)."""
        self.read.add(name)
        if name in self.values and self.values[name] not in supported:
            shown = " or ".join(json.dumps(v) for v in supported)
            raise ConfigError(f"{self._where(name)}={json.dumps(self.values[name])} is not supported by "
                              f"{self.family} here (supported: {shown})")

    def ignore(self, *names: str) -> None:
        """Fields that change nothing once ``get``/``expect`` of others held (e.g. ``sliding_window``
        when ``use_sliding_window`` is false)."""
        self.read.update(names)

    def rope(self) -> tuple[float, Optional[dict[str, Any]]]:
        """(rope_theta, the scaling dict or None), from transformers 5's ``rope_parameters`` or 4's
        ``rope_theta`` + ``rope_scaling``; the scaling dict has ``rope_type`` and its parameters."""
        params = self.get("rope_parameters", default=None)
        if params is not None:
            self.ignore("rope_theta", "rope_scaling")
            if not isinstance(params, dict) or "rope_theta" not in params:
                raise ConfigError(f"{self._where('rope_parameters')}={json.dumps(params)}: expected an object "
                                  f"with rope_theta")
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
            theta = params["rope_theta"]
        else:
            theta = self.get("rope_theta", default=10000.0)
            scaling = dict(self.get("rope_scaling", default=None) or {})
        if "type" in scaling:  # transformers 4's older spelling (5 may save both)
            scaling.setdefault("rope_type", scaling["type"])
            del scaling["type"]
        if scaling.get("rope_type", "default") == "default":
            return float(theta), None
        return float(theta), scaling

    def finish(self) -> None:
        unread = sorted(k for k in self.values if k not in self.read and k not in BOOKKEEPING)
        if unread:
            shown = ", ".join(f"{k}={json.dumps(self.values[k])}" for k in unread[:6])
            raise ConfigError(f"{self.source}: {shown} not modelled by {self.family} here; the checkpoint "
                              f"may compute something this project does not (remove the field only if it "
                              f"changes nothing)")


def fields_of(config: HFConfig, table: dict[str, Any], **defaults: Any) -> dict[str, Any]:
    """Our values of config.json's fields in ``table`` (ours -> theirs, or a tuple of aliases whose
    first is written): each required, but for the ``defaults`` given."""
    return {ours: config.get(*_aliases(theirs), default=defaults.get(ours, REQUIRED)) for ours, theirs in table.items()}


def config_of(ours: Any, table: dict[str, Any]) -> dict[str, Any]:
    """config.json's fields in ``table`` (ours -> theirs) of the dataclass ``ours``."""
    return {_aliases(theirs)[0]: getattr(ours, name) for name, theirs in table.items()}


def _aliases(theirs: Any) -> tuple[str, ...]:
    return theirs if isinstance(theirs, tuple) else (theirs,)


def decoder_fields(config: HFConfig, fields: dict[str, Any] = DECODER_FIELDS, **defaults: Any) -> dict[str, Any]:
    """``fields_of`` a decoder's table, where ``n_kv_heads`` defaults to n_heads and ``head_dim`` to
    dim / n_heads (``defaults`` override; REQUIRED: none)."""
    dim, heads = config.get("hidden_size"), config.get("num_attention_heads")
    values = fields_of(config, fields, **{"n_kv_heads": heads, "head_dim": _DERIVED, **defaults})
    if values.get("head_dim") is _DERIVED:
        values["head_dim"] = dim // heads
    return values


def scaling_fields(scaling: dict[str, Any], expected_type: str, fields: tuple[str, ...], where: str) -> dict[str, Any]:
    """The ``fields`` of a RoPE scaling dict of ``rope_type`` ``expected_type``; anything else refused."""
    kind = scaling.get("rope_type")
    if kind != expected_type:
        raise ConfigError(f"{where}: rope_type={json.dumps(kind)} is not supported here (supported: "
                          f"\"default\", \"{expected_type}\")")
    extra = sorted(set(scaling) - set(fields) - {"rope_type"})
    if extra:
        raise ConfigError(f"{where}: {expected_type} RoPE field(s) {', '.join(extra)} not modelled here")
    missing = [f for f in fields if f not in scaling]
    if missing:
        raise ConfigError(f"{where}: {expected_type} RoPE needs {', '.join(missing)}")
    return {f: scaling[f] for f in fields}


def sliding_window_fields(config: HFConfig, *, switch: Optional[str] = None, default_window: Optional[int] = None,
                          per_layer: bool = True) -> tuple[Optional[int], Optional[list[str]]]:
    """``(model.sliding_window, model.layer_types)`` for ``config`` (config/job.py's meaning): None
    and None when every layer attends to all earlier tokens.

    ``switch`` (Qwen 2's ``use_sliding_window``): while it is false the window's size and
    ``max_window_layers`` change nothing; when true, layers from ``max_window_layers`` on slide
    (transformers' rule), unless ``layer_types`` names each layer. Without one, ``sliding_window``
    (``default_window`` when config.json leaves it out: transformers' default for the family)
    applies to every layer (``per_layer=False``: Mistral and Mixtral, whose models read no
    ``layer_types``), and a window that reaches past ``max_position_embeddings`` is full attention.
    """
    n_layers = config.get("num_hidden_layers")
    if switch is not None and not config.get(switch, default=False):
        config.ignore("sliding_window", "max_window_layers", "layer_types")
        return None, None
    window = config.get("sliding_window", default=default_window)
    if switch is None and window is not None and window >= config.get("max_position_embeddings"):
        window = None
    types = config.get("layer_types", default=None) if per_layer else None
    if not per_layer:
        config.ignore("layer_types")
    if switch is not None:
        first = config.get("max_window_layers", default=n_layers)
        if types is None:
            types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(n_layers)]
    if types is not None:
        if len(types) != n_layers or any(t not in ("full_attention", "sliding_attention") for t in types):
            raise ConfigError(f"{config.source}: layer_types={json.dumps(types)}: expected one of \"full_attention\", "
                              f"\"sliding_attention\" for each of the {n_layers} layers")
        if "sliding_attention" in types and window is None:
            raise ConfigError(f"{config.source}: layer_types has sliding layers but sliding_window=null")
    if window is None or (types is not None and "sliding_attention" not in types):
        return None, None
    return window, None if types is None or all(t == "sliding_attention" for t in types) else list(types)


def uniform_sliding_window(args: Any, subject: str) -> Optional[int]:
    """config.json's one ``sliding_window`` for a family whose Hugging Face model slides every layer
    alike (Mistral, Mixtral, Phi-3): None without sliding layers; a ConfigError (``subject`` names
    the family and its verb) when ``model.layer_types`` mixes sliding and full layers."""
    if args.sliding_window is not None and args.layer_types is not None and len(set(args.layer_types)) > 1:
        raise ConfigError(f"model.layer_types={args.layer_types}: {subject} one sliding_window to every layer; "
                          f"export needs every layer alike (layer_types=None)")
    return None if args.layer_types is not None and "sliding_attention" not in args.layer_types else args.sliding_window
