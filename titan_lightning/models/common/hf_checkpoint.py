"""Hugging Face safetensors checkpoints: the files, and the state-dict adapters that rename.

Layout, as ``transformers`` writes and reads it:

    one file     <folder>/model.safetensors
    sharded      <folder>/model-00001-of-00003.safetensors ... and
                 <folder>/model.safetensors.index.json:
                 {"metadata": {"total_size": <bytes>}, "weight_map": {name: file, ...}}

Each file carries the metadata {"format": "pt"}, which ``transformers`` requires. Files are
written whole on the CPU; a sharded (DTensor) state dict must be gathered first.

A model family's ``StateDictAdapter`` declares tables that map its parameter names and layouts
to Hugging Face's (``to_hf``) and back (``from_hf``); ``load_into`` and ``save_from`` join
that to the files, with strict key and shape checks.
"""

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from titan_lightning.checkpoint import Source, load_sources
from titan_lightning.config import ConfigError
from titan_lightning.models.common.hf_config import HFConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

PathLike = Union[str, os.PathLike]


def shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def _standalone(t: Tensor, seen: set[int]) -> Tensor:
    """``t`` on the CPU, contiguous, owning its whole storage and sharing it with no other
    tensor saved (safetensors refuses views, e.g. one expert of a stacked weight)."""
    t = t.detach().cpu()
    ptr = t.untyped_storage().data_ptr()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes or ptr in seen:
        t = t.clone(memory_format=torch.contiguous_format)
    seen.add(t.untyped_storage().data_ptr())
    return t


def split_shards(state_dict: dict[str, Tensor], max_shard_bytes: int) -> list[dict[str, Tensor]]:
    """``state_dict`` as saveable tensors (``_standalone``) in files of at most ``max_shard_bytes``
    (tensors in their given order, none split; a larger tensor gets a file of its own); [] for {}."""
    seen: set[int] = set()
    shards: list[dict[str, Tensor]] = []
    size = 0
    for name, t in state_dict.items():
        t = _standalone(t, seen)
        if not shards or (shards[-1] and size + t.nbytes > max_shard_bytes):
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    return shards


def save_hf_safetensors(state_dict: dict[str, Tensor], folder: PathLike, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``state_dict`` as one ``model.safetensors``, or, when it is larger than
    ``max_shard_bytes``, as numbered shards (tensors in their given order, none split) and an index.

    Checkpoint files of an earlier save in ``folder`` (``model.safetensors``, the index,
    ``model-*-of-*.safetensors``) are removed first, so no stale shard or index survives.
    """
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} must be a positive integer")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        if old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.fullmatch(old.name):
            old.unlink()
    shards = split_shards(state_dict, max_shard_bytes) or [{}]
    weight_map = write_shards(shards, folder, first=0, total=len(shards))
    if len(shards) > 1:
        write_index(folder, weight_map, sum(t.nbytes for shard in shards for t in shard.values()))


def write_shards(shards: list[dict[str, Tensor]], folder: Path, *, first: int, total: int) -> dict[str, str]:
    """``shards`` as the files ``first + 1``.. of ``total`` in ``folder`` (``model.safetensors``
    when ``total`` is 1), with the metadata transformers requires; their name -> file map."""
    weight_map = {}
    for k, shard in enumerate(shards, start=first + 1):
        file = SINGLE_FILE if total == 1 else shard_name(k, total)
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    return weight_map


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def load_hf_safetensors(folder: PathLike) -> dict[str, Tensor]:
    """Every tensor of the checkpoint in ``folder`` (one file or an index and its shards), on the CPU."""
    tensors = HFTensors.open(folder)
    return {name: tensors.read(name) for name in tensors.keys()}


def _weight_map(folder: Path) -> Optional[dict[str, str]]:
    """The index's name -> file map, or None for a one-file checkpoint; one-line errors."""
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        if not (folder / SINGLE_FILE).is_file():
            raise FileNotFoundError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}: not a Hugging Face checkpoint folder")
        return None
    try:
        return dict(json.loads(index_path.read_text())["weight_map"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{index_path}: not a safetensors index with a 'weight_map' ({type(err).__name__}: {err})")


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class _Entry:
    """One tensor of a safetensors file: where its bytes are, and reads of blocks of it."""

    def __init__(self, path: Path, dtype: torch.dtype, shape: tuple[int, ...], begin: int) -> None:
        self.path, self.dtype, self.shape, self.begin = path, dtype, shape, begin

    def read(self, index: tuple[slice, ...]) -> Tensor:
        """The block ``index`` (slices of the leading dims): the rows it spans are read, then cut."""
        rows = index[0] if index else slice(0, self.shape[0] if self.shape else 1)
        row_numel = math.prod(self.shape[1:]) if self.shape else 1
        row_bytes = row_numel * self.dtype.itemsize
        count = max(rows.stop - rows.start, 0)
        buffer = torch.empty(count * row_bytes, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.begin + rows.start * row_bytes)
            if f.readinto(buffer.numpy()) != buffer.numel():
                raise ValueError(f"{self.path}: truncated (a tensor's bytes end past the file)")
        block = buffer.view(self.dtype).reshape(count, *self.shape[1:]) if self.shape else buffer.view(self.dtype)[0]
        rest = index[1:]
        return block[(slice(None), *rest)].clone() if any(_cuts(s, n) for s, n in zip(rest, self.shape[1:])) else block


def _cuts(s: slice, n: int) -> bool:
    return (s.start or 0) != 0 or (s.stop if s.stop is not None else n) != n


def _read_header(path: Path) -> dict[str, _Entry]:
    """The tensors a safetensors file declares, checked as safetensors does; one-line errors."""
    def corrupt(why: str) -> ValueError:
        return ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {why}")

    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise corrupt("shorter than its 8-byte header length")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise corrupt(f"header length {length} exceeds the file")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as err:
            raise corrupt(f"header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise corrupt("header is not a JSON object")
    header.pop("__metadata__", None)
    try:
        tensors = sorted((info["data_offsets"][0], name, info) for name, info in header.items())
    except (KeyError, TypeError, IndexError) as err:
        raise corrupt(f"a header entry lacks data_offsets ({err!r})") from None
    entries, end = {}, 0
    for _, name, info in tensors:
        begin, stop = info["data_offsets"]
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise corrupt(f"{name} has dtype {info.get('dtype')}, which this reader does not know")
        shape = tuple(info.get("shape", ()))
        if begin != end or stop - begin != math.prod(shape) * dtype.itemsize:
            raise corrupt(f"{name}'s bytes [{begin}, {stop}) do not follow the previous tensor or fit its shape")
        entries[name], end = _Entry(path, dtype, shape, 8 + length + begin), stop
    if 8 + length + end != size:
        raise corrupt(f"the tensors end at byte {8 + length + end}, the file at {size}")
    return entries


class HFTensors:
    """A checkpoint's tensors by Hugging Face name, read on demand: names and shapes from the file
    headers, values whole or as blocks (``read(name, index)``: only those bytes leave the file).
    ``HFTensors.of(state_dict)`` serves tensors in memory the same way."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Callable[[str, tuple[slice, ...]], Tensor]) -> None:
        self._shapes, self._read = shapes, read

    @classmethod
    def of(cls, state_dict: dict[str, Tensor]) -> "HFTensors":
        return cls({k: tuple(t.shape) for k, t in state_dict.items()}, lambda name, index: state_dict[name][index])

    @classmethod
    def open(cls, folder: PathLike) -> "HFTensors":
        """The checkpoint in ``folder`` (one file, or an index and its shards), headers read, no
        tensor. Blocks are read with positioned reads of the rows they span, not through a memory
        map, so a rank's resident memory holds what it reads and nothing of the rest."""
        folder = Path(folder)
        weight_map = _weight_map(folder)
        files = [SINGLE_FILE] if weight_map is None else list(dict.fromkeys(weight_map.values()))
        entries: dict[str, _Entry] = {}
        for file in files:
            path = folder / file
            if not path.is_file():
                raise FileNotFoundError(f"{path}: checkpoint file is missing" + (f" (listed in {INDEX_FILE})" if weight_map else ""))
            header = _read_header(path)
            if weight_map is not None:
                listed = {name for name, f in weight_map.items() if f == file}
                if listed != header.keys():
                    missing, extra = sorted(listed - header.keys()), sorted(header.keys() - listed)
                    raise ValueError(f"{path}: tensors do not match {INDEX_FILE}: missing {missing}, not listed {extra}")
            entries.update(header)
        return cls({name: entry.shape for name, entry in sorted(entries.items())},
                   lambda name, index: entries[name].read(index))

    def keys(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str, index: tuple[slice, ...] = ()) -> Tensor:
        """The tensor ``name``, or its block ``index`` (one slice per leading dim)."""
        return self._read(name, index)

    def source(self, name: str) -> Source:
        return Source(self.shape(name), lambda index: self.read(name, index))


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

    def __init__(self, args: Any, *, tie_word_embeddings: bool = False):
        self.args, self.tie_word_embeddings = args, tie_word_embeddings

    def check_exportable(self) -> None:
        """A model that trains a routing bias Hugging Face's family has no place for is refused."""
        moe = getattr(self.args, "moe", None)
        if moe is not None and moe.load_balance_coeff is not None and EXPERT_BIAS not in self.layer_keys:
            raise ConfigError(
                f"checkpoint.export_format=hf: Hugging Face {self.family}-MoE has no routing bias, and "
                f"model.moe.load_balance_coeff={moe.load_balance_coeff} trains one, so the export would route "
                f"differently from the trained model; set model.moe.load_balance_coeff=null (as a run from a "
                f"Hugging Face folder does) or export_format=dcp")

    # -- config.json (models/common/hf_config.py) --------------------------------------------------

    hf_model_types: tuple[str, ...] = ()  # the config.json model_type values this family reads

    @classmethod
    def args_from_hf_config(cls, config: HFConfig) -> Any:
        """The family's args for a config.json: every field mapped, checked or refused by name."""
        raise NotImplementedError(f"{cls.__name__} does not read config.json")

    @classmethod
    def hf_config(cls, args: Any) -> dict[str, Any]:
        """The config.json fields (model_type, architectures, shapes ...) that describe ``args``;
        a one-line ConfigError where transformers cannot express them."""
        raise NotImplementedError(f"{cls.__name__} does not write config.json")

    def hf_key(self, ours: str) -> Optional[str]:
        """The Hugging Face name of our key (``*`` for the experts of a stacked one), or None."""
        match = _OUR_LAYER.fullmatch(ours)
        if match is None:
            return _TOP_KEYS.get(ours)
        layer, name = match.groups()
        if name in self.expert_keys:
            return f"model.layers.{layer}.{self.experts_prefix}.*.{self.expert_keys[name]}.weight"
        return f"model.layers.{layer}.{self.layer_keys[name]}" if name in self.layer_keys else None

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

    def _permute_rope(self, name: str, hf_key: str, ours: str, w: Tensor, *, to_hf: bool) -> Tensor:
        """``w`` with the rows of each head from our adjacent pairs to Hugging Face's halves, or back."""
        head_dim = self._rope_heads(name, hf_key, ours, tuple(w.shape))
        return w if head_dim is None else _permute_heads(w, head_dim, to_hf=to_hf)

    def _rope_source(self, name: str, hf_key: str, ours: str, tensors: HFTensors) -> Source:
        """Our rows a..b of a per-head permuted key: the whole heads around them, permuted, cut."""
        shape = tensors.shape(hf_key)
        head_dim = self._rope_heads(name, hf_key, ours, shape)
        if head_dim is None:
            return tensors.source(hf_key)

        def read(index: tuple[slice, ...]) -> Tensor:
            rows, rest = index[0], index[1:]
            first, last = rows.start // head_dim * head_dim, -(-rows.stop // head_dim) * head_dim
            block = _permute_heads(tensors.read(hf_key, (slice(first, last), *rest)), head_dim, to_hf=False)
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
