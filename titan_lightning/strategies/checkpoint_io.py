"""What TitanStrategy's checkpoint hooks do: model and optimizer state in and out of the sharded
model, our sharded atomic folders (titan_lightning/checkpoint.py writes them), a single full
file (``save_distributed_checkpoint=False``, as ModelParallelStrategy) and the sharded folders of
Lightning's ModelParallelStrategy.

Every function runs on every rank, collectively; ``writer`` (a ``CheckpointWriter``) agrees on
failures, so a rank never waits alone in a collective.
"""

import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titan_lightning import checkpoint as ckpt
from titan_lightning.checkpoint import CheckpointError, CheckpointWriter
from titan_lightning.lora import has_adapters

# Wrappers whose attribute torch's state-dict functions leave out of a parameter's name
# (torch.compile's OptimizedModule, activation checkpointing's wrapper, FSDP1's).
_WRAPPER_ATTRIBUTES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def _clean_name(name: str) -> str:
    """A parameter's name as ``get_optimizer_state_dict`` keys it: ``model._orig_mod.0.weight`` -> ``model.0.weight``."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_ATTRIBUTES)


def _optimizer_names(model: torch.nn.Module, optimizer) -> list[str]:
    """The parameter names of ``optimizer``, in its own order (what its state_dict indexes)."""
    names = {id(param): _clean_name(name) for name, param in model.named_parameters()}
    return [names[id(param)] for group in optimizer.param_groups for param in group["params"]]


def _names_to_indices(state: dict[str, Any], model: torch.nn.Module, optimizer) -> dict[str, Any]:
    index = {name: i for i, name in enumerate(_optimizer_names(model, optimizer))}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]],
    }


def _indices_to_names(state: dict[str, Any], model: torch.nn.Module, optimizer) -> dict[str, Any]:
    names = _optimizer_names(model, optimizer)
    if any(isinstance(key, str) for key in state.get("state", {})):
        return state  # already keyed by name
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[index] for index in group["params"]]} for group in state["param_groups"]],
    }


# -- what a checkpoint holds -------------------------------------------------------------------

def _options(model: torch.nn.Module, **options: Any) -> StateDictOptions:
    """``options``; for a model with adapters (LoRA) its trainable parameters alone are saved and
    loaded (megabytes): the frozen base comes from ``checkpoint.initial_load_path`` on every start
    (callbacks/weights.py), and DCP's load still asks for every key the checkpoint should hold."""
    if has_adapters(model):
        options.update(ignore_frozen_params=True, strict=False)
    return StateDictOptions(**options)


def model_state(model: torch.nn.Module, *, full: bool) -> dict[str, Any]:
    """This rank's shards (DTensors); ``full``: the full tensors on rank 0 (empty elsewhere)."""
    if full:  # (a sharded save checks its DTensors itself)
        ckpt.check_placements(model.named_parameters())
    return get_model_state_dict(model, options=_options(model, full_state_dict=full, cpu_offload=full))


def optimizer_state(model: torch.nn.Module, optimizer, *, full: bool, rank: int, pipeline: bool) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (flattened per parameter), so each pipeline
    stage saves its own and a checkpoint loads on another layout."""
    if full:
        # As ModelParallelStrategy: the whole state on rank 0, keyed as a plain optimizer's
        # state_dict() (parameter indices), so torch.optim loads it without this project.
        state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return _names_to_indices(state, model, optimizer) if rank == 0 else {}
    options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=False)
    state = get_optimizer_state_dict(model, optimizer, options=options)
    if not pipeline:
        # Also the param groups as ModelParallelStrategy saves them (a list; small values), so
        # that it resumes from this checkpoint too. Under PP each stage has groups of its own:
        # only the flattened ones (per parameter) say which is which.
        # (built from the optimizer's groups: asking torch for the nested state would rebuild all of it)
        names = {id(param): _clean_name(name) for name, param in model.named_parameters()}
        state["param_groups"] = [{**{k: v for k, v in group.items() if k != "params"},
                                  "params": [names[id(param)] for param in group["params"]]}
                                 for group in optimizer.param_groups]
    return state


def _rank_state(module: Any, world_size: int, layout: Optional[str]) -> dict[str, Any]:
    """What this rank alone knows: its RNG states and its data module's position."""
    state: dict[str, Any] = {"rng": ckpt.rng_states(), "world_size": world_size, "layout": layout}
    datamodule = getattr(module.trainer, "datamodule", None)
    if datamodule is not None and hasattr(datamodule, "state_dict"):
        state["datamodule"] = datamodule.state_dict()
    return state


# -- save and remove ---------------------------------------------------------------------------

def save(writer: CheckpointWriter, checkpoint: dict[str, Any], path: Path, module: Any, *, full: bool, rank: int,
         world_size: int, layout: Optional[str]) -> None:
    """Sharded, atomic save (see titan_lightning/checkpoint.py), asynchronous when the module's job
    says so; ``full``: one file."""
    if full:
        _save_full(writer, checkpoint, path, rank)
        return
    job = getattr(module, "job", None)
    async_save = bool(job is not None and job.checkpoint.async_save)
    trainer = module.trainer
    last = trainer.should_stop or 0 < (trainer.max_steps or 0) <= trainer.global_step  # (nothing else shows)
    writer.save(checkpoint, path, rank=rank, rank_state=_rank_state(module, world_size, layout),
                async_save=async_save, announce=last)


def _save_full(writer: CheckpointWriter, checkpoint: dict[str, Any], path: Path, rank: int) -> None:
    """One file written by rank 0 (``torch.load(path)["state_dict"]`` loads into a plain module),
    under a temporary name until complete."""
    writer.wait()

    def write() -> None:
        if rank != 0:
            return
        if path.is_dir():
            if not ckpt.is_complete(path):
                raise ckpt.CheckpointIsADirectoryError(f"{path} exists and is a directory that is not a checkpoint; "
                                                       f"not replacing it with a file")
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ckpt.PARTIAL)
        torch.save(checkpoint, partial)
        os.replace(partial, path)

    writer.agree(write, lambda error: f"saving checkpoint {path} failed: {ckpt._describe(error, folder=path.parent)}")


def remove(writer: CheckpointWriter, path: Path, *, rank: int) -> None:
    """keep_latest_k: an older checkpoint folder goes, never leaving a half-deleted one that looks whole."""
    if path.is_file():  # a full checkpoint (save_distributed_checkpoint=False)
        if rank == 0:
            path.unlink()
        return
    writer.remove(path, rank=rank)


# -- load --------------------------------------------------------------------------------------

def load(writer: CheckpointWriter, path: Path, model: torch.nn.Module, optimizers: list, module: Any, *, rank: int,
         world_size: int, weights_only: bool) -> dict[str, Any]:
    """Model and optimizer from the shards (any layout), the rest from meta.pt, this rank's RNG
    and data position from the manifest (when the checkpoint was saved by as many ranks); a full
    file or Lightning's sharded folder as such. Returns what Lightning restores itself."""
    strict = module.strict_loading
    if path.is_file():
        ckpt.check_placements(model.named_parameters())
        return _load_full(writer, path, model, optimizers, strict=strict, weights_only=weights_only)
    if ckpt.is_lightning_sharded(path):
        return _load_lightning_sharded(writer, path, model, optimizers, strict=strict, rank=rank,
                                       weights_only=weights_only)
    manifest = writer.agree(lambda: ckpt.verify(path, ranks=False))
    same_world = manifest["world_size"] == world_size
    mine = writer.agree(lambda: ckpt.load_rank_state(path, rank, manifest) if same_world else None)
    checkpoint = writer.agree(lambda: ckpt.load_meta(path, weights_only=weights_only))
    if not same_world and rank == 0:
        print(f"[checkpoint] {path} was saved by {manifest['world_size']} ranks, this run has {world_size}: "
              f"RNG states start from training.seed, the data position is derived from the global sample count",
              flush=True)
    _load_states(writer, path, model, optimizers, strict=strict, flatten_optimizer_state_dict=True)
    if mine is not None:
        ckpt.set_rng_states(mine["rng"])
        datamodule = getattr(module.trainer, "datamodule", None)
        if datamodule is not None and "datamodule" in mine:
            checkpoint[type(datamodule).__qualname__] = mine["datamodule"]
    return checkpoint


def _load_full(writer: CheckpointWriter, path: Path, model: torch.nn.Module, optimizers: list, *, strict: bool,
               weights_only: bool) -> dict[str, Any]:
    """A single-file (full) checkpoint into the sharded model and optimizers: every rank maps
    the file and keeps its own shards."""
    checkpoint = writer.agree(lambda: torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only))
    options = _options(model, full_state_dict=True, strict=strict)
    set_model_state_dict(model, checkpoint.pop("state_dict"), options=options)
    states = checkpoint.pop("optimizer_states", [])
    if optimizers and len(states) != len(optimizers):
        raise CheckpointError(f"checkpoint {path} holds {len(states)} optimizer state(s); this run has "
                              f"{len(optimizers)} optimizer(s)")
    for optimizer, state in zip(optimizers, states):
        set_optimizer_state_dict(model, optimizer, _indices_to_names(state, model, optimizer), options=options)
    return checkpoint


def _load_states(writer: CheckpointWriter, path: Path, model: torch.nn.Module, optimizers: list, *, strict: bool,
                 flatten_optimizer_state_dict: bool) -> None:
    """The model's and every optimizer's state from the DCP shards in ``path`` (any layout);
    optimizer state flattened per parameter (ours) or nested (Lightning's strategies)."""
    options = _options(model, flatten_optimizer_state_dict=flatten_optimizer_state_dict, strict=strict)
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model, options=options)}
    for index, optimizer in enumerate(optimizers):
        state[f"optimizer_{index}"] = get_optimizer_state_dict(model, optimizer, options=options)
    writer.agree(lambda: ckpt.load_sharded(path, state, group=writer.group))
    set_model_state_dict(model, state["state_dict"], options=options)
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{index}"], options=options)


def _load_lightning_sharded(writer: CheckpointWriter, path: Path, model: torch.nn.Module, optimizers: list, *,
                            strict: bool, rank: int, weights_only: bool) -> dict[str, Any]:
    """A sharded checkpoint of Lightning's ModelParallelStrategy (DCP shards and meta.pt, no
    manifest): the model and optimizer states in its layout (optimizer state keyed by parameter
    name, not flattened); no RNG or data position (it saves none)."""
    _load_states(writer, path, model, optimizers, strict=strict, flatten_optimizer_state_dict=False)
    checkpoint = writer.agree(lambda: ckpt.load_meta(path, weights_only=weights_only))
    if rank == 0:
        print(f"[checkpoint] {path} was saved by Lightning's ModelParallelStrategy: model and optimizer "
              f"restored; RNG states and the data position it does not save", flush=True)
    return checkpoint
