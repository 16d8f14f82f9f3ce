"""Checkpoint folders for the tests that check them before launch: one small checkpoint saved once
per process (one step of the debug model cut to width 64 and 2 layers), and damaged copies of it."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import torch

from titan_lightning.checkpoint import MANIFEST_KEY, META, read_dcp_metadata

_SAVED: list[Path] = []

# The debug model cut to width 64 and 2 layers: what `small_checkpoint` saves.
SMALL_MODEL = ["--job.model.dim", "64", "--job.model.n_layers", "2", "--job.model.n_heads", "4",
               "--job.model.n_kv_heads", "4"]


def small_checkpoint() -> Path:
    """A complete checkpoint of `SMALL_MODEL` after one step, saved once per process into a
    temporary folder of its own (removed at exit); copy it before changing it."""
    if _SAVED:
        return _SAVED[0]
    from recipes.llama3 import debugmodel
    from titan_lightning.recipe import execute
    from titan_lightning.trainer import RUN_DIR_ENV, build_trainer

    root = Path(tempfile.mkdtemp(prefix="titan_small_checkpoint_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    before = os.environ.get(RUN_DIR_ENV)
    os.environ[RUN_DIR_ENV] = str(root / "small_run")
    try:
        run = debugmodel()
        model, training = run.job.model, run.job.training
        model.dim, model.n_layers, model.n_heads, model.n_kv_heads = 64, 2, 4, 4
        training.seq_len, training.tokens_per_microbatch_per_dp_rank = 64, 128
        run.job.checkpoint.interval = 1
        run.trainer.update(max_steps=1, limit_val_batches=0, logger=False, enable_progress_bar=False,
                           enable_model_summary=False)
        execute("fit", run, build_trainer(run))
    finally:
        os.environ.pop(RUN_DIR_ENV) if before is None else os.environ.__setitem__(RUN_DIR_ENV, before)
    (path,) = (root / "small_run" / "checkpoints").iterdir()
    _SAVED.append(path)
    return path


def byte_of(path: Path, tensor: str) -> tuple[str, int]:
    """(shard file, offset) of a byte in the middle of ``tensor``'s data (a DCP key)."""
    for index, info in read_dcp_metadata(path).storage_data.items():
        if index.fqn == tensor:
            return info.relative_path, info.offset + info.length // 2
    raise KeyError(tensor)


def flip_bit(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x10
    file.write_bytes(bytes(data))


def damaged_copies(root: Path) -> None:
    """Copies of the small checkpoint under ``root``: ckpt_small (whole), ckpt_bitflip (one bit of
    output.weight flipped), ckpt_bad_metadata (bytes of .metadata flipped), ckpt_truncated (its
    shard cut short), ckpt_no_shard (its shard deleted), ckpt_old_truncated (a manifest without
    checksums, as saved before they were recorded, and its shard cut short)."""
    saved = small_checkpoint()
    copies = {name: root / name for name in ("ckpt_small", "ckpt_bitflip", "ckpt_bad_metadata", "ckpt_truncated",
                                             "ckpt_no_shard", "ckpt_old_truncated")}
    for folder in copies.values():
        shutil.copytree(saved, folder)
    shard, offset = byte_of(saved, "state_dict.model.output.weight")
    flip_bit(copies["ckpt_bitflip"] / shard, offset)
    metadata = copies["ckpt_bad_metadata"] / ".metadata"
    for at in range(200, 216):
        flip_bit(metadata, at)
    for name in ("ckpt_truncated", "ckpt_old_truncated"):
        file = copies[name] / shard
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    (copies["ckpt_no_shard"] / shard).unlink()
    drop_checksums(copies["ckpt_old_truncated"])


def drop_checksums(folder: Path) -> None:
    """The checkpoint ``folder`` as saved before checksums were recorded: no "files" in its manifest."""
    meta = torch.load(folder / META, weights_only=True)
    del meta[MANIFEST_KEY]["files"]
    torch.save(meta, folder / META)
