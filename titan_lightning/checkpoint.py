"""Distributed checkpoints through Lightning's own flow (ModelCheckpoint, ``Trainer.save_checkpoint``,
``fit(ckpt_path=...)``), for every layout TitanStrategy builds.

A checkpoint is a folder::

    epoch=0-step=5.ckpt/
        .metadata, __<rank>_0.distcp   model and optimizer, sharded (torch.distributed.checkpoint)
        meta.pt                        the rest of Lightning's checkpoint (loops, LR schedulers, callbacks ...)
        rank<r>.pt                     what differs per rank: RNG states, the data module's position

- Model and optimizer are saved by name (the unsplit module names, the optimizer state
  flattened per parameter), so a checkpoint loads on any other layout: another FSDP degree,
  TP, PP stages (each rank reads only its stages' keys).
- A save is atomic: it is written to ``<name>.partial`` and renamed when every rank is
  done; a run killed while writing leaves the previous checkpoint intact and a ``.partial``
  folder that ``latest`` skips (and loading it names what is missing).
- ``async_save``: the tensors are copied to CPU, then written in a background thread
  while training goes on; the rename happens when the write ends (the next save, or the
  end of fit, waits for it).
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import threading
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

# Fault injection for tests: the process dies in the middle of its N-th save (after meta.pt and
# its rank file, before the shards), as a run killed while writing would.
FAULT_ENV = "TITAN_LIGHTNING_FAULT_IN_SAVE"

META = "meta.pt"
PARTIAL = ".partial"
DCP_METADATA = ".metadata"


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the folder and what is wrong."""


# -- what differs per rank ----------------------------------------------------------------


def rng_states() -> dict[str, Any]:
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# -- locating checkpoints ------------------------------------------------------------------


def is_complete(path: Path) -> bool:
    return path.is_dir() and not path.name.endswith(PARTIAL) and (path / META).is_file() and (path / DCP_METADATA).is_file()


def latest_checkpoint(root: Union[str, Path]) -> Optional[Path]:
    """The complete checkpoint with the highest global step under ``root`` (searched recursively)."""
    best, best_key = None, None
    for meta in Path(root).rglob(META):
        folder = meta.parent
        if not is_complete(folder):
            continue
        try:
            step = int(torch.load(meta, map_location="cpu", weights_only=False).get("global_step", -1))
        except Exception:
            continue
        key = (step, meta.stat().st_mtime)
        if best_key is None or key > best_key:
            best, best_key = folder, key
    return best


def resolve_resume(resume_from: Optional[str], runs_root: Path) -> Optional[str]:
    """``resume_from`` as a checkpoint path: None, a folder, or "latest" (the newest under ``runs_root``)."""
    if resume_from is None:
        return None
    if resume_from == "latest":
        found = latest_checkpoint(runs_root)
        if found is None:
            raise CheckpointError(f"checkpoint.resume_from='latest': no complete checkpoint under {runs_root}")
        return str(found)
    path = Path(resume_from)
    if not path.exists():
        raise CheckpointError(f"checkpoint.resume_from={resume_from!r} does not exist")
    return str(path)


# -- save ----------------------------------------------------------------------------------


class _Pending:
    """An asynchronous save in flight: its future and what to do when it completes."""

    def __init__(self, future: Any, finish: Any) -> None:
        self.future, self.finish = future, finish

    def wait(self) -> None:
        self.future.result()
        self.finish()


class CheckpointWriter:
    """Saves Lightning checkpoints as sharded, atomic folders; one per strategy."""

    def __init__(self) -> None:
        self._pending: Optional[_Pending] = None
        self._lock = threading.Lock()
        self._saves = 0

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is on disk under its final name."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def save(self, checkpoint: dict[str, Any], path: Path, *, rank: int, rank_state: dict[str, Any],
             async_save: bool = False) -> None:
        import torch.distributed.checkpoint as dcp

        self.wait()  # one save at a time, in order
        staging = path.with_name(path.name + PARTIAL)
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        _barrier()
        state = {"state_dict": checkpoint.pop("state_dict")}
        for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{index}"] = optimizer_state
        torch.save(rank_state, staging / rank_file(rank))
        if rank == 0:
            torch.save(checkpoint, staging / META)
        self._saves += 1
        if os.environ.get(FAULT_ENV) == str(self._saves):
            os._exit(137)

        def finish() -> None:
            if rank == 0:  # DCP's coordinator writes .metadata last, after every rank's data
                _replace_dir(staging, path)

        if not async_save:
            dcp.save(state, checkpoint_id=str(staging))
            _barrier()
            finish()
            _barrier()
            return
        state = _to_cpu(state)  # the training step may change the tensors while they are written
        future = dcp.async_save(state, checkpoint_id=str(staging))
        with self._lock:
            self._pending = _Pending(future, finish)


def _replace_dir(staging: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _to_cpu(state: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_cpu(v) for v in state]
    if isinstance(state, DTensor):
        local = state.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, state.device_mesh, state.placements, run_check=False,
                                  shape=state.shape, stride=state.stride())
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    return state


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# -- load ----------------------------------------------------------------------------------


def check_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Fail with one message naming ``path`` and what is missing or mismatched, before reading tensors."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import DTensor

    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a file; TitanStrategy checkpoints are folders (sharded)")
    absent = [name for name in (DCP_METADATA, META) if not (path / name).is_file()]
    if absent or path.name.endswith(PARTIAL):
        raise CheckpointError(
            f"checkpoint {path} is incomplete (missing {', '.join(absent) or 'nothing, but it is a .partial folder'}): "
            f"a save that did not finish; resume from an earlier checkpoint"
        )
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as error:
        raise CheckpointError(f"checkpoint {path}: cannot read {DCP_METADATA}: {error}") from error
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state)
    missing = sorted(k for k in flat if k not in saved)
    mismatched = []
    for key, value in flat.items():
        meta = saved.get(key)
        if isinstance(value, (torch.Tensor, DTensor)) and isinstance(meta, TensorStorageMetadata):
            if tuple(meta.size) != tuple(value.shape):
                mismatched.append(f"{key}: saved {tuple(meta.size)}, model {tuple(value.shape)}")
    if missing or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} keys missing ({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})")
        if mismatched:
            parts.append(f"shapes differ ({'; '.join(mismatched[:3])}{' ...' if len(mismatched) > 3 else ''})")
        raise CheckpointError(f"checkpoint {path} does not match this run: {'; '.join(parts)}")
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: shard file {name} is missing")
        if file.stat().st_size < size:
            raise CheckpointError(
                f"checkpoint {path}: shard file {name} is truncated ({file.stat().st_size} of {size} bytes)"
            )


def load_sharded(path: Path, state: dict[str, Any]) -> None:
    """Read ``state`` (tensors updated in place) from the checkpoint folder ``path``."""
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.api import CheckpointException

    check_checkpoint(path, state)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as error:
        failures = getattr(error, "failures", None)
        cause = next(iter(failures.values())) if failures else error
        if isinstance(cause, tuple):  # (exception, traceback frames)
            cause = cause[0]
        text = str(cause).strip().split(". ")[0].splitlines()
        raise CheckpointError(f"checkpoint {path}: reading the shards failed ({type(cause).__name__}: "
                              f"{text[0] if text else ''}); the files may be truncated") from error


def load_meta(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / META, map_location="cpu", weights_only=False)
    except (EOFError, pickle.UnpicklingError, RuntimeError) as error:
        raise CheckpointError(f"checkpoint {path}: {META} is unreadable ({error})") from error


def load_rank_state(path: Path, rank: int) -> Optional[dict[str, Any]]:
    file = path / rank_file(rank)
    if not file.is_file():
        return None
    return torch.load(file, map_location="cpu", weights_only=False)


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


# -- full (unsharded) weights into a sharded model -----------------------------------------


@torch.no_grad()
def load_full_state_dict(
    model: torch.nn.Module, state: dict[str, torch.Tensor], *, source: str = "state dict", partial: bool = False
) -> None:
    """Copy full tensors into ``model``'s parameters and buffers, sharding DTensors locally.

    Every key of the model must be in ``state`` with the same global shape, and no other key;
    ``partial=True`` (a pipeline rank, which holds some stages) lets ``state`` have more.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    own = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if partial:
        unexpected = []
    if missing or unexpected:
        raise KeyError(f"{source} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, target in own.items():
        full = state[name]
        if tuple(full.shape) != tuple(target.shape):
            raise ValueError(f"{source}: {name} has shape {tuple(full.shape)}, the model's is {tuple(target.shape)}")
        if isinstance(target, DTensor):
            full = full.to(device=target.device, dtype=target.dtype)
            local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
            target.to_local().copy_(local)
        else:
            target.copy_(full.to(device=target.device, dtype=target.dtype))
