"""Locating and checking checkpoints by their completion manifest (kept in ``meta.pt``, written
last; ``checkpoint.json`` in the first format): which folders are complete, the newest one, and
every listed file of its size and crc32 before a run starts from it."""

from __future__ import annotations

import json
import logging
import pickle
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning_utilities.core.rank_zero import rank_zero_only

from titan_lightning.checkpoint.dcp import _check_shards, read_dcp_metadata
from titan_lightning.checkpoint.errors import CheckpointError, NotACheckpointError
from titan_lightning.checkpoint.files import (DCP_METADATA, FORMAT, FORMAT_1, MANIFEST, MANIFEST_KEY, META, PARTIAL,
                                              load_meta, rank_file)

log = logging.getLogger(__name__)

# What a load without the crc32 check risks (said where a check is skipped and where one fails).
UNCHECKED = "a flipped bit in a weight or in optimizer state would be trained on, unnoticed"

# A manifest is a few hundred bytes (a meta.pt with it: Lightning's loops and callbacks and every
# rank's RNG states, kilobytes a rank); anything much larger is not ours and is not read.
_MANIFEST_MAX_BYTES = 1 << 20
_META_MAX_BYTES = 256 << 20

# meta.pt's manifest by (folder, mtime, size): a launch reads it several times.
_READ: dict[tuple[str, int, int], Optional[dict[str, Any]]] = {}


def read_manifest(path: Path) -> Optional[dict[str, Any]]:
    """The completion manifest of the checkpoint folder ``path``, or None when it has no valid one.

    Reads one small file and runs no code from it (``meta.pt`` weights-only, or the first format's
    JSON): safe on folders nobody here wrote."""
    if (path / MANIFEST).is_file():
        return _read_json_manifest(path / MANIFEST)
    file = path / META
    try:
        if not file.is_file():
            return None
        stat = file.stat()
    except OSError:
        return None
    key = (str(file), stat.st_mtime_ns, stat.st_size)
    if key not in _READ:
        _READ.clear()
        _READ[key] = _read_meta_manifest(file, stat.st_size)
    return _READ[key]


def _read_meta_manifest(file: Path, size: int) -> Optional[dict[str, Any]]:
    if size > _META_MAX_BYTES:
        return None
    try:
        meta = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, OSError, UnicodeDecodeError,
            AttributeError, KeyError, TypeError, zipfile.BadZipFile):
        return None
    manifest = meta.get(MANIFEST_KEY) if isinstance(meta, dict) else None
    return manifest if _valid(manifest, FORMAT) and isinstance(manifest.get("ranks"), list) else None


def _read_json_manifest(file: Path) -> Optional[dict[str, Any]]:
    try:
        if file.stat().st_size > _MANIFEST_MAX_BYTES:
            return None
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if _valid(manifest, FORMAT_1) else None


def _valid(manifest: Any, form: str) -> bool:
    return (isinstance(manifest, dict) and manifest.get("format") == form
            and isinstance(manifest.get("global_step"), int) and isinstance(manifest.get("world_size"), int))


def is_complete(path: Path) -> bool:
    return (path.is_dir() and not path.name.endswith(PARTIAL) and read_manifest(path) is not None
            and (path / META).is_file() and (path / DCP_METADATA).is_file())


def latest_checkpoint(root: Union[str, Path]) -> Optional[Path]:
    """The complete checkpoint with the highest global step under ``root`` (searched recursively).

    Only the manifests are read (weights-only); no checkpoint is loaded to decide."""
    best, best_key = None, None
    for file in Path(root).rglob(META):
        folder = file.parent
        if not is_complete(folder):
            continue
        key = (read_manifest(folder)["global_step"], file.stat().st_mtime)
        if best_key is None or key > best_key:
            best, best_key = folder, key
    return best


def resolve_resume(resume_from: Optional[str], runs_root: Path, *, checksums: bool = True) -> Optional[str]:
    """``resume_from`` as a checkpoint path: None, a checkpoint folder, or "latest" (the newest
    under ``runs_root``; None when there is none yet: the run starts fresh). Its files are checked
    (``check_files``; ``checksums``: their crc32 too) and meta.pt read, without running code."""
    if resume_from is None:
        return None
    if resume_from == "latest":
        found = latest_checkpoint(runs_root)
        if found is None:
            return None
        path, what = found, f"checkpoint.resume_from='latest' ({found})"
    else:
        path, what = Path(resume_from), f"checkpoint.resume_from={resume_from!r}"
        if not path.exists():
            raise CheckpointError(f"{what} does not exist; give a checkpoint folder "
                                  f"(<run>/checkpoints/epoch=...-step=....ckpt) or 'latest'")
    check_files(path, verify(path, what=what), what=what, checksums=checksums)
    load_meta(path)  # readable without running code, before any process starts
    return str(path)


def unfinished_checkpoints(root: Union[str, Path]) -> list[Path]:
    """Folders under ``root`` with shards but no valid manifest: saves that did not finish, or
    checkpoints of a titan_lightning that wrote no manifest (neither is resumed from)."""
    return sorted(metadata.parent for metadata in Path(root).rglob(DCP_METADATA)
                  if (metadata.parent / META).exists() and read_manifest(metadata.parent) is None)


def is_lightning_sharded(path: Path) -> bool:
    """A finished sharded checkpoint of Lightning's ModelParallelStrategy (or FSDPStrategy): DCP's
    ``.metadata`` and Lightning's ``meta.pt``, readable and without a manifest of ours (ours are
    renamed into place with theirs, so a folder of ours is never without it; an unreadable meta.pt
    is not taken for Lightning's, so that loading it names the damage)."""
    if not (path.is_dir() and not path.name.endswith(PARTIAL) and (path / DCP_METADATA).is_file()
            and (path / META).is_file() and not (path / MANIFEST).exists()):
        return False
    if read_manifest(path) is not None:  # (ours: meta.pt read once, by the manifest's cache)
        return False
    try:
        meta = torch.load(path / META, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - unreadable: not Lightning's checkpoint as far as we can tell
        return False
    return isinstance(meta, dict) and MANIFEST_KEY not in meta


def verify(path: Path, *, what: Optional[str] = None, ranks: bool = True) -> dict[str, Any]:
    """Fail with one line unless ``path`` is a complete checkpoint whose files are all there;
    returns its manifest. ``ranks``: also check every rank file the manifest lists."""
    what = what or f"checkpoint {path}"
    if not path.is_dir():
        raise NotACheckpointError(f"{what} is a file; TitanStrategy checkpoints are folders (sharded)")
    manifest = read_manifest(path)
    if manifest is None:
        inner = latest_checkpoint(path)
        hint = (f"; it holds checkpoints, the newest is {inner}" if inner is not None
                else "; a save that did not finish leaves such a folder (.partial)" if (path / META).exists()
                else "")
        raise NotACheckpointError(f"{what} does not point to a valid checkpoint: not complete (no manifest of "
                                  f"titan_lightning in {META}){hint}")
    first_format = manifest["format"] == FORMAT_1
    names = [DCP_METADATA, META] + ([rank_file(r) for r in range(manifest["world_size"])]
                                    if ranks and first_format else [])
    for name in names:
        if not (path / name).is_file():
            raise CheckpointError(f"{what}: {name} is missing (saved by {manifest['world_size']} ranks)")
    if ranks and not first_format and len(manifest["ranks"]) != manifest["world_size"]:
        raise CheckpointError(f"{what}: {META} holds the states of {len(manifest['ranks'])} ranks, saved by "
                              f"{manifest['world_size']}; it changed after the save: use another checkpoint")
    return manifest


def check_files(path: Path, manifest: Optional[dict[str, Any]], *, what: Optional[str] = None,
                checksums: bool = True) -> None:
    """Fail with one line naming the first file of the checkpoint ``path`` that is missing, of
    another size than saved, or (``checksums``) of another crc32; then read its .metadata (no code
    run) and check that every shard it points into is there and long enough. A manifest without
    ``files`` (saved before checksums were recorded) or None (an export) gets the last part only.
    A checkpoint whose crc32 is not checked (``checksums`` off, or a manifest without them) is said
    so in one warning line once its files pass."""
    what = what or f"checkpoint {path}"
    files = _listed_files(manifest, what) if manifest is not None else {}
    for name, (size, _) in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{what}: {name} is missing (the checkpoint was saved with it)")
        found = file.stat().st_size
        if found != size:
            state = "truncated" if found < size else "longer than saved"
            raise CheckpointError(f"{what}: {name} is {state} ({found} bytes, {size} when saved); the file "
                                  f"changed after the save: use another checkpoint")
    if checksums and files:
        names = list(files)
        with ThreadPoolExecutor(max_workers=min(8, len(names))) as pool:  # zlib releases the GIL
            found_crcs = list(pool.map(lambda name: _crc32(path / name), names))
        for name, crc in zip(names, found_crcs):
            if crc != files[name][1]:
                raise CheckpointError(
                    f"{what}: {name} is corrupt (crc32 {crc:08x}, {files[name][1]:08x} when saved); use another "
                    f"checkpoint (checkpoint.verify_checksums=false loads it as it is: the damaged bytes are "
                    f"trained on)")
        if manifest.get("format") == FORMAT:
            _check_meta_records(path / META, what)
    if not (path / DCP_METADATA).is_file():
        raise CheckpointError(f"{what}: {DCP_METADATA} is missing")
    _check_shards(path, read_dcp_metadata(path, what), what)
    if manifest is not None and (not checksums or not files) and getattr(rank_zero_only, "rank", 0) == 0:
        why = "checkpoint.verify_checksums=false" if files else "its manifest records no checksums (an older save)"
        log.warning(f"titan-lightning: {what}: loaded without a crc32 check ({why}); files checked for presence "
                    f"and size only: {UNCHECKED}")



def _listed_files(manifest: dict[str, Any], what: str) -> dict[str, tuple[int, int]]:
    """The manifest's ``files`` as {name: (bytes, crc32)}; {} when it has none. Names are plain file
    names of the folder (a crafted manifest cannot send the check elsewhere)."""
    files = manifest.get("files")
    if files is None:
        return {}
    ok = isinstance(files, dict) and all(
        isinstance(name, str) and name and "/" not in name and "\\" not in name and name not in (".", "..")
        and isinstance(entry, list) and len(entry) == 2 and all(isinstance(v, int) and v >= 0 for v in entry)
        for name, entry in files.items())
    if not ok:
        where = MANIFEST if manifest.get("format") == FORMAT_1 else f"the manifest in {META}"
        raise CheckpointError(f"{what}: {where} lists its files in a form not written here; it was changed "
                              f"after the save")
    return {name: (entry[0], entry[1]) for name, entry in files.items()}


def _check_meta_records(file: Path, what: str) -> None:
    """meta.pt holds the manifest, so the manifest cannot list it: torch.save's zip archive records
    each entry's crc32 itself (torch.load does not check them; this does)."""
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, RuntimeError, ValueError) as error:
        bad = f"its archive ({error})"
    if bad is not None:
        raise CheckpointError(f"{what}: {META} is corrupt ({bad} differs from its recorded crc32); use another "
                              f"checkpoint")


def _crc32(file: Path, chunk: int = 16 << 20) -> int:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc

