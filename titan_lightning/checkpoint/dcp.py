"""Reading DCP's sharded files without running code: ``.metadata`` through an unpickler that
admits only DCP's own metadata classes, non-tensor items with ``weights_only=True``; checks of a
folder against a model (keys, shapes, shard files) before any tensor is read."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Optional

import torch

from titan_lightning._compat import flatten_state_dict, set_element
from titan_lightning.checkpoint.errors import _FAILURES, CheckpointError, NotACheckpointError, _describe
from titan_lightning.checkpoint.files import DCP_METADATA, PARTIAL
from titan_lightning.checkpoint.placements import _dtensor_slots, _one_chunk_placements


_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "pathlib._local": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and refuses every other global: a crafted file cannot call anything."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _METADATA_GLOBALS.get(module, ())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"refused global {module}.{name} (not a DCP metadata class)")
        return super().find_class(module, name)


def _safe_reader(path: Path):
    """torch's FileSystemReader, its pickled .metadata read by ``_MetadataUnpickler``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            rank = kwargs.get("rank")
            name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
            with open(Path(self.path) / name, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"{name} holds a {type(metadata).__name__}, not DCP Metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


def _safe_planner():
    """DCP's default load planner, its non-tensor items read with ``weights_only=True``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner()


def read_dcp_metadata(path: Path, what: Optional[str] = None):
    """DCP's metadata of the folder ``path``, read without running code; one-line errors."""
    try:
        return _safe_reader(path).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, AttributeError, ImportError, IndexError,
            KeyError, TypeError, MemoryError, OverflowError) as error:
        raise CheckpointError(f"{what or f'checkpoint {path}'}: cannot read {DCP_METADATA} ({_describe(error)})") from None


def check_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Fail with one message naming ``path`` and what is missing or mismatched, before reading tensors."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import DTensor

    if not path.exists():
        raise NotACheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise NotACheckpointError(f"checkpoint {path} is a file; TitanStrategy checkpoints are folders (sharded)")
    absent = [name for name in (DCP_METADATA,) if not (path / name).is_file()]
    if absent or path.name.endswith(PARTIAL):
        raise CheckpointError(
            f"checkpoint {path} is incomplete (missing {', '.join(absent) or 'nothing, but it is a .partial folder'}): "
            f"a save that did not finish; resume from an earlier checkpoint"
        )
    metadata = read_dcp_metadata(path)
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
    _check_shards(path, metadata, f"checkpoint {path}")


def load_sharded(path: Path, state: dict[str, Any], group: Any = None) -> None:
    """Read ``state`` (tensors updated in place) from the checkpoint folder ``path``.

    A DTensor whose shard DCP cannot describe (see ``dcp_saveable``) is read replicated along
    the dims it splits into pieces, then each rank copies its own pieces out of it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import empty

    check_checkpoint(path, state)
    swapped = []  # (container, key, the caller's DTensor, what DCP reads into)
    for container, key, value in _dtensor_slots(state):
        placements = _one_chunk_placements(value, str(key))
        if placements is not None:
            readable = empty(value.shape, dtype=value.dtype, device_mesh=value.device_mesh, placements=placements)
            swapped.append((container, key, value, readable))
            container[key] = readable
    try:
        dcp.load(state, storage_reader=_safe_reader(path), planner=_safe_planner(), process_group=group)
    except _FAILURES as error:
        raise CheckpointError(f"checkpoint {path}: reading the shards failed ({_describe(error)}); "
                              f"the files may be truncated or corrupt") from error
    finally:
        for container, key, value, _ in swapped:
            container[key] = value
    for _, _, value, readable in swapped:
        value.to_local().copy_(readable.redistribute(value.device_mesh, value.placements).to_local())



def check_model_shapes(path: Path, shapes: dict[str, tuple[int, ...]], what: str) -> None:
    """Fail with one line unless the checkpoint ``path`` holds exactly the model tensors ``shapes``
    names (``state_dict.<name>``, global shapes), naming the first that differs and both shapes.
    Reads only DCP's .metadata: before launch, on the model built on the meta device."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = read_dcp_metadata(path, what).state_dict_metadata
    prefix = "state_dict."
    theirs = {key[len(prefix):]: tuple(meta.size) for key, meta in saved.items()
              if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    hint = "; give the model it was saved with (job.model), or a checkpoint of this model"
    for name, shape in shapes.items():
        if name not in theirs:
            raise CheckpointError(f"{what} holds no {name}, which this run's model has ({tuple(shape)}): it is a "
                                  f"checkpoint of another model{hint}")
        if theirs[name] != tuple(shape):
            raise CheckpointError(f"{what}: {name} is {theirs[name]} there, {tuple(shape)} in this run's "
                                  f"model{hint}")
    extra = [name for name in theirs if name not in shapes]
    if extra:
        raise CheckpointError(f"{what} holds {extra[0]} {theirs[extra[0]]}, which this run's model has not"
                              f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}: it is a checkpoint "
                              f"of another model{hint}")



def _check_shards(path: Path, metadata: Any, what: str) -> None:
    """Every shard file DCP's metadata points into is there and holds the bytes it points at."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{what}: shard file {name} is missing")
        if file.stat().st_size < size:
            raise CheckpointError(f"{what}: shard file {name} is truncated ({file.stat().st_size} of {size} bytes)")

