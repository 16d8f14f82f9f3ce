"""Hugging Face checkpoints and our state dicts: the state-dict adapters that rename.

A model family's ``StateDictAdapter`` declares tables that map its parameter names and layouts
to Hugging Face's (``to_hf``) and back (``from_hf``); ``load_into`` and ``save_from`` join
that to the files (``safetensors_io.py``: the safetensors reader and writer), with strict key and
shape checks.
"""

import re
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from titan_lightning.checkpoint import Source, load_sources
from titan_lightning.config import ConfigError
from titan_lightning.models.common.hf_config import DECODER_FIELDS, HFConfig, config_of, decoder_fields
from titan_lightning.models.common.safetensors_io import (  # noqa: F401 (re-exported: their home before safetensors_io.py)
    INDEX_FILE,
    SINGLE_FILE,
    HFTensors,
    PathLike,
    load_hf_safetensors,
    save_hf_safetensors,
    shard_name,
    split_shards,
    write_index,
    write_shards,
)


# Every family's top-level names, then ours inside ``layers.N.`` -> Hugging Face's inside ``model.layers.N.``.
_TOP_KEYS = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
BLOCK_KEYS = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
LLAMA_BLOCK_KEYS = {**BLOCK_KEYS, "attention.wk.weight": "self_attn.k_proj.weight",
                    "attention.wv.weight": "self_attn.v_proj.weight"}
# Our stacked expert weights [E, ...] -> the projection of Hugging Face's ``mlp.experts.J``.
EXPERT_KEYS = {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj", "moe.experts.w2": "down_proj"}
# Layer keys whose rows are permuted per head for RoPE -> the args field with their head count (None: one).
HALF_ROTATED = {"attention.wq.weight": "n_heads", "attention.wk.weight": "n_kv_heads",
                "attention.q_norm.weight": None, "attention.k_norm.weight": None}
EXPERT_BIAS = "moe.expert_bias"

_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _names(keys: list[str], limit: int = 8) -> str:
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _inverse(table: dict[str, str]) -> dict[str, str]:
    return {theirs: ours for ours, theirs in table.items()}


def _permute_heads(w: Tensor, head_dim: int, *, to_hf: bool) -> Tensor:
    """The rows of each ``head_dim``-row head of ``w`` from our adjacent RoPE pairs to Hugging
    Face's halves (``to_hf``), or back."""
    heads = w.shape[0] // head_dim
    per_head = (heads, head_dim // 2, 2) if to_hf else (heads, 2, head_dim // 2)
    return w.reshape(*per_head, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _shape_error(hf_key: str, ours: str, shape: torch.Size, expected: tuple, why: str) -> ValueError:
    what = hf_key.split(".")[-2]
    return ValueError(f"{what} shape {list(shape)} for {hf_key} (ours {ours}) expected {list(expected)} ({why})")


class StateDictAdapter:
    """Converts one model family's state dict to Hugging Face names and layouts (``to_hf``) and
    back (``from_hf``), from the tables the family declares:

    ``layer_keys``     our name inside ``layers.N.`` -> Hugging Face's inside ``model.layers.N.``
    ``expert_keys``    our stacked [E, ...] expert weight -> its projection in ``<experts_prefix>.J.``
                       (``experts_prefix``: ``mlp.experts``; Mixtral's ``block_sparse_moe.experts``)
    ``rope_halves``    layer keys permuted per head (-> the args field with their head count):
                       Hugging Face's RoPE rotates feature i with i + head_dim/2, ours adjacent
                       pairs, so HF feature c * head_dim/2 + i is our feature 2i + c
    ``extra_from_hf``  other names inside ``model.layers.N.`` that ``from_hf`` reads, never writes

    and two hooks: ``permute_heads`` (a RoPE over part of each head permutes only that part) and
    ``export_group`` (keys ``to_hf`` fuses into one tensor are converted together by an export).

    ``moe.expert_bias``, unless ``layer_keys`` names it, has no Hugging Face counterpart: ``to_hf``
    drops it (with a warning if it is not zero: the HF model will route differently) and ``from_hf``
    starts it at zero. ``tie_word_embeddings``: the checkpoint has no ``lm_head.weight``;
    ``from_hf`` copies the embeddings into our untied output, ``to_hf`` refuses an output that
    differs from them. Errors name the Hugging Face key and ours. ``load_into``/``save_from`` work
    on an unsharded, materialized model; values are cast to the model's dtype.
    """

    family: str
    layer_keys: dict[str, str]
    expert_keys: dict[str, str] = {}
    experts_prefix: str = "mlp.experts"
    rope_halves: dict[str, Optional[str]] = {}
    extra_from_hf: dict[str, Callable[[Tensor], dict[str, Tensor]]] = {}
    ignored_hf_suffixes: tuple[str, ...] = ()  # top-level Hugging Face keys from_hf skips
    ignores_layers_past_n_layers = False  # from_hf skips model.layers.N for N >= args.n_layers
    ties_by_default = False  # what a config.json without ``tie_word_embeddings`` means (Gemma 3: tied)
    # A Hugging Face model wrapping this family's text model (a multimodal checkpoint's language model):
    # its module-name prefixes -> the text model's, and the prefixes of its other parts (left out).
    wrapper_prefixes: dict[str, str] = {}
    wrapper_others: tuple[str, ...] = ()

    def __init__(self, args: Any, *, tie_word_embeddings: bool = False):
        self.args, self.tie_word_embeddings = args, tie_word_embeddings

    @classmethod
    def unwrapped(cls, name: str) -> Optional[str]:
        """A Hugging Face module or tensor name of the wrapping model (``wrapper_prefixes``) as the text
        model names it; None for one of its other parts (a vision tower); any other name as it is."""
        prefix = next((p for p in cls.wrapper_prefixes if name.startswith(p)), None)
        if prefix is not None:
            return cls.wrapper_prefixes[prefix] + name[len(prefix):]
        return None if name.startswith(cls.wrapper_others) else name

    @classmethod
    def wrapper_of(cls, folder: Optional[str]) -> Optional[tuple[str, str]]:
        """(the text model's module prefix, the one transformers gives it in the model of ``folder``)
        when that model wraps the text model (a multimodal one); None otherwise, or for no folder."""
        return None

    @classmethod
    def check_config(cls, job: Any) -> None:
        """The family's rules for a run's job (``JobConfig.check_family``, from ``validate_job``): an
        ``export_format=hf`` run trains only what Hugging Face's family holds (no routing bias it has
        no place for) and has args config.json can express (``check_expressible``)."""
        if job.checkpoint.export_format != "hf":
            return
        moe = getattr(job.model, "moe", None)
        if moe is not None and moe.load_balance_coeff is not None and EXPERT_BIAS not in cls.layer_keys:
            raise ConfigError(
                f"checkpoint.export_format=hf: Hugging Face {cls.family}-MoE has no routing bias, and "
                f"model.moe.load_balance_coeff={moe.load_balance_coeff} trains one, so the export would route "
                f"differently from the trained model; set model.moe.load_balance_coeff=null (as a run from a "
                f"Hugging Face folder does) or export_format=dcp")
        cls.check_expressible(job.model)

    # -- config.json (models/common/hf_config.py) --------------------------------------------------
    # Read and written here from the family's declarations; a family overrides the hooks below
    # (``read_fields``, ``read_rope``, ``write_fields``, ``write_rope``) only where it differs.

    hf_model_types: tuple[str, ...] = ()  # the config.json model_type values this family reads; the first is written
    args_class: type  # the family's args
    architecture: str  # config.json's ``architectures`` entry an export writes
    fixed_fields: dict[str, Any] = {}  # config.json fields that must hold the one value implemented here
    config_fields: dict[str, Any] = DECODER_FIELDS  # our args fields -> config.json's, read and written as they are

    @classmethod
    def args_from_hf_config(cls, config: HFConfig) -> Any:
        """The family's args for a config.json: every field mapped, checked or refused by name."""
        for name, value in cls.fixed_fields.items():
            config.expect(name, value)
        return cls.args_class(**cls.read_fields(config))

    @classmethod
    def read_fields(cls, config: HFConfig) -> dict[str, Any]:
        """The args' fields: ``config_fields`` and RoPE's (``read_rope``); a family adds its own."""
        return {**decoder_fields(config, cls.config_fields), **cls.read_rope(config)}

    @classmethod
    def read_rope(cls, config: HFConfig) -> dict[str, Any]:
        """The args' RoPE fields: ``rope_theta``, no scaling."""
        theta, scaling = config.rope()
        if scaling is not None:
            raise ConfigError(f"{config.source}: RoPE scaling {scaling} is not modelled for {cls.family} here "
                              f"(supported: none)")
        return {"rope_theta": theta}

    @classmethod
    def hf_config(cls, args: Any) -> dict[str, Any]:
        """The config.json fields (model_type, architectures, shapes ...) that describe ``args``,
        which ``check_expressible`` passed."""
        cls.check_expressible(args)
        return {"architectures": [cls.architecture], "model_type": cls.hf_model_types[0],
                **config_of(args, cls.config_fields), **cls.write_rope(args), **cls.write_fields(args),
                **cls.fixed_fields}

    @classmethod
    def write_rope(cls, args: Any) -> dict[str, Any]:
        return {"rope_theta": args.rope_theta, "rope_scaling": None}

    @classmethod
    def write_fields(cls, args: Any) -> dict[str, Any]:
        """config.json fields of the family's own (a field already written keeps its place)."""
        return {}

    @classmethod
    def check_expressible(cls, args: Any) -> None:
        """A one-line ConfigError for args that transformers' family cannot express (by default all can)."""

    def hf_key(self, ours: str) -> Optional[str]:
        """The Hugging Face name of our key (``*`` for the experts of a stacked one), or None."""
        match = _OUR_LAYER.fullmatch(ours)
        if match is None:
            return _TOP_KEYS.get(ours)
        layer, name = match.groups()
        if name in self.expert_keys:
            return f"model.layers.{layer}.{self.experts_prefix}.*.{self.expert_keys[name]}.weight"
        return f"model.layers.{layer}.{self.layer_keys[name]}" if name in self.layer_keys else None

    def export_group(self, ours: str) -> str:
        """Our keys that ``to_hf`` converts together (fused into one Hugging Face tensor, as Phi-3's
        q/k/v and gpt-oss's gate/up) share a group; an export hands ``to_hf`` whole groups. By default each key is its own."""
        return ours

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        hf: dict[str, Tensor] = {}
        unknown = []
        for key, value in state_dict.items():
            hf_key, match = self.hf_key(key), _OUR_LAYER.fullmatch(key)
            name = match and match[2]
            if hf_key is None and name == EXPERT_BIAS:
                if value.any():
                    raise ValueError(f"{key} is not zero and Hugging Face {self.family}-MoE has no routing bias: "
                                     f"the export would route differently from the trained model")
            elif hf_key is None:
                unknown.append(key)
            elif name in self.expert_keys:
                hf.update({hf_key.replace("*", str(j)): expert for j, expert in enumerate(value.unbind(0))})
            else:
                hf[hf_key] = self._permute_rope(name, hf_key, key, value, to_hf=True)
        if unknown:
            raise ValueError(f"no Hugging Face {self.family} name for {', '.join(unknown)}")
        if self.tie_word_embeddings:
            output = hf.pop("lm_head.weight")
            if not torch.equal(output, hf["model.embed_tokens.weight"]):
                raise ValueError("tie_word_embeddings=True, but output.weight differs from tok_embeddings.weight; "
                                 "save with tie_word_embeddings=False")
        return hf

    def from_hf(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        return {ours: source.full() for ours, source in self.sources(HFTensors.of(hf_state_dict)).items()}

    def sources(self, tensors: HFTensors) -> dict[str, Source]:
        """Each of our tensors as a ``Source`` reading the blocks of ``tensors`` it is made of (names,
        shapes and expert sets checked from the headers, before anything is read)."""
        top, layer_keys = _inverse(_TOP_KEYS), _inverse(self.layer_keys)
        moe = getattr(self.args, "moe", None)
        expert_keys = _inverse(self.expert_keys) if moe is not None else {}
        sd: dict[str, Source] = {}
        experts: dict[str, dict[int, str]] = {}  # our stacked key -> J -> HF key
        hf_expert = re.compile(rf"{re.escape(self.experts_prefix)}\.(\d+)\.(\w+)\.weight")
        unknown = []
        for key in tensors.keys():
            match = _HF_LAYER.fullmatch(key)
            layer, name = match.groups() if match else (None, key)
            expert = hf_expert.fullmatch(name)
            if key in top:
                sd[top[key]] = tensors.source(key)
            elif match is None:
                if not key.endswith(self.ignored_hf_suffixes):
                    unknown.append(key)
            elif self.ignores_layers_past_n_layers and int(layer) >= self.args.n_layers:
                continue
            elif name in layer_keys:
                ours = f"layers.{layer}.{layer_keys[name]}"
                sd[ours] = self._rope_source(layer_keys[name], key, ours, tensors)
            elif expert is not None and expert[2] in expert_keys:
                experts.setdefault(f"layers.{layer}.{expert_keys[expert[2]]}", {})[int(expert[1])] = key
            elif name in self.extra_from_hf:
                sd.update({f"layers.{layer}.{ours}": source for ours, source in self._extra_sources(name, key, tensors).items()})
            else:
                unknown.append(key)
        if unknown:
            raise ValueError(f"no {self.family} name for Hugging Face keys {_names(sorted(unknown))}")
        for key, by_index in experts.items():
            sd[key] = self._stack(key, by_index, tensors)
        if self.tie_word_embeddings and "output.weight" not in sd and "tok_embeddings.weight" in sd:
            embeddings = sd["tok_embeddings.weight"]
            sd["output.weight"] = Source(embeddings.shape, lambda index: embeddings.read(index).clone())
        if EXPERT_BIAS not in self.layer_keys and moe is not None and moe.load_balance_coeff is not None:
            for layer in range(self.args.n_layers):
                sd[f"layers.{layer}.{EXPERT_BIAS}"] = Source.of(torch.zeros(moe.num_experts, dtype=torch.float32))
        return sd

    def _rope_heads(self, name: str, hf_key: str, ours: str, shape: tuple[int, ...]) -> Optional[int]:
        """The head width of a layer key permuted per head (checking its rows), None for others."""
        if name not in self.rope_halves:
            return None
        field = self.rope_halves[name]
        heads, head_dim = getattr(self.args, field) if field else 1, self.args.head_dim
        if shape[0] != heads * head_dim:
            raise _shape_error(hf_key, ours, shape, (heads * head_dim, *shape[1:]), f"{heads} heads of {head_dim}")
        return head_dim

    def permute_heads(self, w: Tensor, head_dim: int, *, to_hf: bool) -> Tensor:
        """The rows of whole heads of ``w`` between our RoPE layout and Hugging Face's; a family whose
        RoPE rotates part of each head (Phi-4-mini) permutes only that part."""
        return _permute_heads(w, head_dim, to_hf=to_hf)

    def _permute_rope(self, name: str, hf_key: str, ours: str, w: Tensor, *, to_hf: bool) -> Tensor:
        """``w`` with the rows of each head from our adjacent pairs to Hugging Face's halves, or back."""
        head_dim = self._rope_heads(name, hf_key, ours, tuple(w.shape))
        return w if head_dim is None else self.permute_heads(w, head_dim, to_hf=to_hf)

    def _rope_source(self, name: str, hf_key: str, ours: str, tensors: HFTensors) -> Source:
        """Our rows a..b of a per-head permuted key: the whole heads around them, permuted, cut."""
        shape = tensors.shape(hf_key)
        head_dim = self._rope_heads(name, hf_key, ours, shape)
        if head_dim is None:
            return tensors.source(hf_key)

        def read(index: tuple[slice, ...]) -> Tensor:
            rows, rest = index[0], index[1:]
            first, last = rows.start // head_dim * head_dim, -(-rows.stop // head_dim) * head_dim
            block = self.permute_heads(tensors.read(hf_key, (slice(first, last), *rest)), head_dim, to_hf=False)
            return block[rows.start - first:rows.stop - first]

        return Source(shape, read)

    def _extra_sources(self, name: str, hf_key: str, tensors: HFTensors) -> dict[str, Source]:
        """``extra_from_hf[name]``'s tensors (shapes from a meta run); each read takes the whole HF tensor."""
        convert = self.extra_from_hf[name]
        shapes = {ours: tuple(t.shape) for ours, t in convert(torch.empty(tensors.shape(hf_key), device="meta")).items()}
        return {ours: Source(shape, lambda index, ours=ours: convert(tensors.read(hf_key))[ours][index])
                for ours, shape in shapes.items()}

    def _stack(self, ours: str, by_index: dict[int, str], tensors: HFTensors) -> Source:
        n = self.args.moe.num_experts
        missing, extra = sorted(set(range(n)) - by_index.keys()), sorted(by_index.keys() - set(range(n)))
        if missing or extra:
            raise ValueError(f"{self.hf_key(ours)} (ours {ours}): expected experts 0..{n - 1} "
                             f"(model.moe.num_experts={n}), missing {missing[:8]}, extra {extra[:8]}")
        first = tensors.shape(by_index[0])
        for j, key in sorted(by_index.items()):
            if tensors.shape(key) != first:
                raise _shape_error(key, f"{ours}[{j}]", tensors.shape(key), first, f"as {by_index[0]}")

        def read(index: tuple[slice, ...]) -> Tensor:
            experts = range(n)[index[0]]
            parts = [tensors.read(by_index[j], index[1:]) for j in experts]
            return torch.stack(parts) if parts else torch.empty((0, *first))[(slice(None), *index[1:])]

        return Source((n, *first), read)

    def _check(self, expected: dict[str, Tensor], got: dict[str, Tensor], what: str) -> None:
        """Raise one line naming the missing and unexpected tensors, or the first shape that differs."""
        missing, unexpected = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
        if missing or unexpected:
            raise ValueError(f"{what}: missing keys [{self._both(missing)}]; "
                             f"unexpected keys [{self._both(unexpected)}]")
        for name, t in expected.items():
            if got[name].shape != t.shape:
                raise ValueError(f"{what}: {self._both([name])} has shape {tuple(got[name].shape)}, "
                                 f"the model has {tuple(t.shape)}")

    def _both(self, keys: list[str]) -> str:
        return _names([f"{self.hf_key(k)} (ours {k})" if self.hf_key(k) else k for k in keys])

    def check_folder(self, model: nn.Module, folder: PathLike, *, partial: bool = False) -> dict[str, Source]:
        """The tensors of the Hugging Face checkpoint in ``folder`` as ``model``'s (a model on the
        meta device will do: only the file headers are read), every key and shape checked, and
        every file's size against its header (a truncated file); one-line errors naming them."""
        sources = self.sources(HFTensors.open(folder))
        own = model.state_dict()
        self._check(own, sources if not partial else {k: v for k, v in sources.items() if k in own},
                    f"loading {folder} into {type(model).__name__}")
        return sources

    def load_into(self, model: nn.Module, folder: PathLike, *, partial: bool = False) -> None:
        """Load the Hugging Face checkpoint in ``folder`` into ``model`` (sharded or not: each
        DTensor reads only its local block); every key must match (``partial``: a pipeline rank's
        stages take the keys they hold)."""
        sources = self.check_folder(model, folder, partial=partial)
        load_sources(model, sources, source=str(folder), partial=partial)

    def save_from(self, model: nn.Module, folder: PathLike, max_shard_bytes: int = 5 * 2**30) -> None:
        """Save ``model`` as a Hugging Face checkpoint in ``folder``."""
        save_hf_safetensors(self.to_hf(model.state_dict()), folder, max_shard_bytes)
