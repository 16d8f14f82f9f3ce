"""A TP plan checked against the model it shards, and the model's own code made to fit it.

``checked_plan`` refuses, before anything is sharded, what would fail or train wrong: unknown styles,
patterns matching nothing, indivisible split dims, a sequence-parallel plan with nothing to carry
the shards, a fused q, k, v projection under plain ``colwise``, head counts that cannot be per-rank.

Head counts. Colwise projections give each rank 1/tp of the heads, so a module that
reshapes with a head count (``q.view(B, T, self.n_head, hs)``) must read the local count.
``apply_tp`` divides these integer attributes by tp, in place:

- found by name on every module that owns a colwise-sharded child (the attention) and on
  that module's ``config`` object: ``HEAD_COUNT_NAMES`` (n_head, num_attention_heads,
  n_query_groups, ...), when they are plain instance attributes and the module's class reads
  them (the code of its methods names them: an MLP holding the model's config does not).
  A ``config`` shared by every block (LitGPT) is divided once, and only when every module that
  holds it and reads the count (but the root) has its projections sharded: an MLP-only plan
  leaves the attention's counts alone; a plan sharding some attention modules and not others
  that read the same config is refused before anything is sharded.
- declared in the plan with the style ``heads``: the pattern names a module, then
  attributes, e.g. ``"blocks.*.attn.n_head": "heads"`` or ``"config.n_head": "heads"``.

Nothing else is touched: hidden sizes (n_embd, dim), head sizes and ratios such as ``n_head //
n_query_groups`` stay (the ratio is the same locally). A shape computed from a hidden size or
the input's last dim (``C // self.n_head``, ``split(self.n_embd)``) stays global: such a module
fails under TP, and its error names it and what to declare (parallel/tensor_shape_errors.py). No
check sees a global head count under a name of its own with -1 for the head size
(``view(B, T, self.nh, -1)``): it runs, on heads of the wrong size; declare such a count.

Fused q, k, v projections. Rows stacked as [all q; all k; all v] (LitGPT's ``qkv``, nanoGPT's
``c_attn``) need ``colwise_fused:3``: plain ``colwise`` would give rank 0 the q rows and some k
rows, and the forward would run, silently wrong. So plain ``colwise`` on a linear whose output
width is (heads + 2 x query groups) x head size of the attention owning it (read by name from it
or its ``config``, in a class that reads the head count) is refused; rows grouped per query
group, which plain colwise shards right, are declared ``colwise_grouped``. Under grouped-query
attention the stacked blocks are of unequal size, which ``colwise_fused`` (equal blocks) cannot
split: refused too, shard the MLP only (the attention stays whole on every rank).
"""

import functools
from dataclasses import dataclass
from fnmatch import fnmatchcase
from types import CodeType, FunctionType
from typing import Any, Callable, NamedTuple, Optional

from torch import nn

from titan_lightning.config import ConfigError
from titan_lightning.parallel.contracts import ContractError
from titan_lightning.parallel.tensor_styles import FUSED, HEADS, TPStyle, parse_style, valid_styles

# What an attention module (or its config) calls its query heads and its key/value heads.
_QUERY_HEAD_NAMES = ("n_head", "n_heads", "num_heads", "num_attention_heads")
_KV_HEAD_NAMES = ("n_kv_heads", "n_kv_head", "num_key_value_heads", "n_query_groups", "num_kv_heads")
# Integer attributes that count heads, localized on the owners of colwise children and their ``config``.
HEAD_COUNT_NAMES = (*_QUERY_HEAD_NAMES, *_KV_HEAD_NAMES)
# Its head size and its width, for recognizing a fused q, k, v projection (``_check_fused_qkv``).
_HEAD_SIZE_NAMES = ("head_size", "head_dim")
_WIDTH_NAMES = ("n_embd", "dim", "hidden_size", "embed_dim")


class Entry(NamedTuple):  # a module a plan entry matched, and its style
    pattern: str
    fqn: str
    module: nn.Module
    style: str  # as the plan spells it: 'colwise_fused:3'
    record: TPStyle
    parts: Optional[int]  # the style's argument


@dataclass
class HeadCount:  # an integer attribute that counts heads, to divide by tp
    label: str  # where it is, from the model: "blocks.0.attn.config.n_head"
    owner: Any  # the module or config object holding it
    attr: str
    value: int


def checked_plan(
    model: nn.Module, plan: dict[str, str], tp: int, sequence_parallel: bool
) -> tuple[list[Entry], list[HeadCount]]:
    """The plan's module entries and the head counts to divide by ``tp``, all checked."""
    _check_sequence_parallel(plan, sequence_parallel)
    entries = [entry for pattern, style in plan.items() if style != HEADS for entry in _resolve(model, pattern, style)]
    for entry in entries:
        _check_fused_qkv(model, entry)  # (before: it explains an indivisible block size)
        _check_divisible(entry, tp)
    return entries, _head_counts(model, plan, entries, tp)


def _check_sequence_parallel(plan: dict[str, str], sequence_parallel: bool) -> None:
    """Under sequence parallelism a rowwise layer returns the hidden states sharded on the
    sequence: something must carry them (a sharded embedding, norms, gathered block inputs)."""
    styles = {record.name for record, _ in map(parse_style, plan.values()) if record is not None}
    if sequence_parallel and "rowwise" in styles and not styles & {"embedding", "norm", "prepare_block_input"}:
        raise ConfigError(
            "parallelism.sequence_parallel=True, but the TP plan has rowwise layers (which then return the hidden "
            "states sharded on the sequence) and no 'embedding', 'norm' or 'prepare_block_input' entries to carry "
            "them; declare those (see titan_lightning/parallel/tensor.py) or set parallelism.sequence_parallel=False"
        )


def _resolve(model: nn.Module, pattern: str, style: str) -> list[Entry]:
    record, parts = parse_style(style)
    if record is None:
        raise ValueError(f"TP plan entry {pattern!r}: unknown style {style!r}; valid styles are {valid_styles()}")
    matches, removed = match(model, pattern)
    if not matches and not removed:
        raise ValueError(
            f"TP plan pattern {pattern!r} (style {style!r}) matches no module of {type(model).__name__}; "
            f"patterns are module names with '*' for one name part, e.g. 'layers.*.attention.wq'"
        )
    if record.name == FUSED:
        for fqn, module in matches:
            if not isinstance(module, nn.Linear):
                raise ValueError(f"TP style {style!r} shards an nn.Linear; {fqn} is a {type(module).__name__}")
    return [Entry(pattern, fqn, module, style, record, parts) for fqn, module in matches]


def match(model: nn.Module, pattern: str, attributes: bool = False) -> tuple[list[tuple[str, Any]], int]:
    """Modules whose name matches ``pattern`` part by part, and how many matched slots are None.

    A None slot is a submodule a pipeline stage removed (``model.output = None``): it is
    skipped, not an error. With ``attributes``, a part that names no submodule may name a plain
    attribute (a config object), matched exactly.
    """
    frontier: list[tuple[str, Any]] = [("", model)]
    removed = 0
    for part in pattern.split(".") if pattern else []:
        found = []
        for fqn, obj in frontier:
            children = obj._modules if isinstance(obj, nn.Module) else {}  # named_children() hides None slots
            names = [name for name in children if fnmatchcase(name, part)]
            removed += sum(children[name] is None for name in names)
            found += [(join(fqn, name), children[name]) for name in names if children[name] is not None]
            if attributes and not names and getattr(obj, part, None) is not None:
                found.append((join(fqn, part), getattr(obj, part)))
        frontier = found
    return frontier, removed


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _check_divisible(entry: Entry, tp: int) -> None:
    dim, parts = entry.record.sharded_weight_dim, entry.parts
    weight = getattr(entry.module, "weight", None)
    if dim is None or weight is None:
        return
    size = weight.shape[dim] // (parts or 1)  # of each block
    if weight.shape[dim] % (tp * (parts or 1)):
        blocks = f" into {parts} blocks of {size}, each" if parts else ""
        raise ValueError(
            f"TP style {entry.style!r} splits dim {dim} of {entry.fqn}.weight {tuple(weight.shape)}{blocks}, "
            f"which is not divisible by parallelism.tp={tp}; choose a tp degree that divides {size}"
        )


# -- head counts ------------------------------------------------------------------------------


def _head_counts(model: nn.Module, plan: dict[str, str], resolved: list[Entry], tp: int) -> list[HeadCount]:
    """The head counts to divide by tp: declared ones, then those found by name; each object's
    attribute once (a config shared by every block is one object)."""
    found: dict[tuple[int, str], HeadCount] = {}
    candidates = [head for pattern, style in plan.items() if style == HEADS
                  for head in _resolve_heads(model, pattern)]
    owners = owners_of_sharded(model, resolved, lambda record: record.splits_heads)
    for fqn, owner in owners.items():
        for prefix, obj in ((fqn, owner), (join(fqn, "config"), getattr(owner, "config", None))):
            attributes = vars(obj) if obj is not None and hasattr(obj, "__dict__") else {}
            # Instance attributes only: a property or an alias (HF's attribute_map) is not a count of its own.
            candidates += [(join(prefix, name), obj, name) for name in HEAD_COUNT_NAMES
                           if _is_count(attributes.get(name)) and _reads(owner, name)]
    for label, obj, attr in candidates:
        found.setdefault((id(obj), attr), HeadCount(label, obj, attr, getattr(obj, attr)))
    for count in found.values():
        _check_shared(model, count, owners)
        if count.value % tp:
            raise ConfigError(
                f"tensor parallelism gives each of parallelism.tp={tp} ranks 1/{tp} of the heads, but "
                f"{count.label}={count.value} is not divisible by {tp}; choose a tp that divides {count.value}"
            )
        try:
            setattr(count.owner, count.attr, count.value)  # the same value: can it be set at all?
        except AttributeError as error:
            raise ContractError(f"{count.label} counts heads and must become {count.value // tp} under "
                                f"parallelism.tp={tp}, but it cannot be set: {error}") from error
    return list(found.values())


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_shared(model: nn.Module, count: HeadCount, owners: dict[str, nn.Module]) -> None:
    """A count on an object other modules hold too (LitGPT's one ``Config``) becomes per-rank for
    all of them: refused unless every submodule holding it whose class reads the count owns
    head-sharded projections (the root, which only holds the model, does not count)."""
    if isinstance(count.owner, nn.Module):
        return
    holders = [(fqn, module) for fqn, module in model.named_modules()
               if fqn and any(value is count.owner for value in vars(module).values())]
    whole = [f"{fqn} ({type(module).__name__})" for fqn, module in holders
             if fqn not in owners and _reads(module, count.attr)]
    if whole:
        more = f" and {len(whole) - 3} more" if len(whole) > 3 else ""
        raise ContractError(
            f"{count.label} counts heads and the tp_plan shards heads of modules that read it, but the same "
            f"{type(count.owner).__name__} object is read by {', '.join(whole[:3])}{more}, which the plan does not "
            f"shard: made per-rank, it would be wrong there; shard the projections of every module that reads it, or "
            f"none of them (and declare no 'heads' on it)"
        )


def _reads(module: nn.Module, name: str) -> bool:
    """Whether the code of ``module``'s class (its methods and its bases', torch's excepted) names
    ``name``: an attribute or global it loads or stores, or a string constant (``getattr(obj, "n_head")``)."""
    return name in _names_in_code(type(module))


@functools.cache
def _names_in_code(cls: type) -> frozenset[str]:
    names: set[str] = set()
    for base in cls.__mro__:
        if base is object or base.__module__.split(".")[0] == "torch":
            continue
        for value in vars(base).values():
            for code in _code_of(value, set()):
                names |= _names(code)
    return frozenset(names)


def _code_of(value: Any, seen: set[int]) -> list[CodeType]:
    """The code objects of a class attribute: a function's (a static or class method's, a property's
    accessors'), and those of what it wraps (``__wrapped__``, or a function held in its closure)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [code for accessor in (value.fget, value.fset, value.fdel) for code in _code_of(accessor, seen)]
    if not callable(value) or isinstance(value, type) or id(value) in seen:
        return []
    seen.add(id(value))
    inner = [getattr(value, "__wrapped__", None), *_closure(value)]
    own = [value.__code__] if isinstance(value, FunctionType) else []
    return own + [code for function in inner for code in _code_of(function, seen)]


def _closure(value: Any) -> list[Any]:
    values = []
    for cell in getattr(value, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell (a name not bound yet)
            continue
    return values


def _names(code: CodeType) -> set[str]:
    """Attributes and globals ``code`` loads or stores, identifier-like string constants, and those of
    the functions, lambdas and comprehensions nested in it."""
    strings = {const for const in code.co_consts if isinstance(const, str) and const.isidentifier()}
    return set(code.co_names).union(strings, *(_names(c) for c in code.co_consts if isinstance(c, CodeType)))


# -- fused q, k, v projections ----------------------------------------------------------------


def _check_fused_qkv(model: nn.Module, entry: Entry) -> None:
    """Refuse a colwise style that would give a rank the wrong rows of a fused q, k, v projection,
    where the layout can be known: the linear's output width is (heads + 2 x query groups) x head
    size of the attention owning it, and that attention's class reads its head count."""
    pattern, fqn, module, style, record, parts = entry
    if record.name not in ("colwise", FUSED) or not isinstance(module, nn.Linear):
        return
    owner_fqn = fqn.rpartition(".")[0]
    owner = model.get_submodule(owner_fqn)
    sizes = _attention_sizes(owner)
    if sizes is None:
        return
    heads, groups, head_size, head_name = sizes
    if module.out_features != (heads + 2 * groups) * head_size or not _reads(owner, head_name):
        return
    if record.name == FUSED and parts == 3 and heads == groups:
        return
    where = (f"{fqn} ({module.out_features} output rows: ({heads} heads + 2 x {groups} query groups) x head size "
             f"{head_size}, as {owner_fqn or 'the model'} ({type(owner).__name__}) declares)")
    if heads == groups:
        fix = f"use '{FUSED}:3' (rank r computes [q_r; k_r; v_r])"
    else:
        fix = (f"under grouped-query attention its blocks are of unequal size (q {heads * head_size} rows, k and v "
               f"{groups * head_size} each), which '{FUSED}' (equal blocks) cannot split: leave "
               f"{owner_fqn or 'the attention'}'s projections out of tp_plan and shard the MLP only")
    raise ContractError(
        f"tp_plan entry {pattern!r}: style {style!r} on {where} would give each rank the wrong rows where they are "
        f"stacked [all q; all k; all v] (LitGPT's qkv, nanoGPT's c_attn): {fix}; rows grouped per query group "
        f"([q; k; v] of group 0, then of group 1, ...: GPT-NeoX, Falcon) are sharded right by 'colwise_grouped'"
    )


def _attention_sizes(owner: nn.Module) -> Optional[tuple[int, int, int, str]]:
    """(query heads, key/value heads, head size, the head count's name) that a module or its
    ``config`` declares by the usual names; None where it declares no head count."""
    def first(names: tuple[str, ...]) -> tuple[Optional[int], str]:
        for obj in (owner, getattr(owner, "config", None)):
            for name in names:
                value = getattr(obj, name, None) if obj is not None else None
                if _is_count(value) and value > 0:
                    return value, name
        return None, ""

    heads, head_name = first(_QUERY_HEAD_NAMES)
    if heads is None:
        return None
    groups = first(_KV_HEAD_NAMES)[0] or heads
    head_size = first(_HEAD_SIZE_NAMES)[0]
    if head_size is None:
        width = first(_WIDTH_NAMES)[0]
        head_size = width // heads if width is not None and width % heads == 0 else None
    return None if head_size is None else (heads, groups, head_size, head_name)


def _resolve_heads(model: nn.Module, pattern: str) -> list[tuple[str, Any, str]]:
    """(label, object, attribute) for a ``heads`` entry: module names (``*`` for one part),
    then plain attributes (a config object), then the integer attribute."""
    path, _, attr = pattern.rpartition(".")
    frontier, removed = match(model, path, attributes=True)
    matches = [(join(fqn, attr), obj, attr) for fqn, obj in frontier if hasattr(obj, attr)]
    if not matches and not removed:
        raise ValueError(
            f"TP plan entry {pattern!r} (style {HEADS!r}) matches no attribute of {type(model).__name__}; name a "
            f"module ('*' for one name part), then the integer attribute: 'blocks.*.attn.n_head' or 'config.n_head'"
        )
    for label, obj, name in matches:
        if not _is_count(getattr(obj, name)):
            raise ValueError(f"TP plan entry {pattern!r} (style {HEADS!r}): {label} is {getattr(obj, name)!r}, "
                             f"not an integer head count")
    return matches


def owners_of_sharded(model: nn.Module, resolved: list[Entry],
                      which: Callable[[TPStyle], bool]) -> dict[str, nn.Module]:
    """The modules that own a child sharded with a style ``which`` takes (an attention, an MLP), by fqn."""
    owners: dict[str, nn.Module] = {}
    for entry in resolved:
        if which(entry.record):
            parent = entry.fqn.rpartition(".")[0]
            owners.setdefault(parent, model.get_submodule(parent))
    return owners
