"""Checkpoint folders below the Trainer: what a broken or mismatched one reports, which one is
the latest, the checkpoint config. Multi-process save/resume: tests/integration_tests/test_resume.py."""

import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_lightning.checkpoint import (
    DCP_METADATA,
    FORMAT,
    MANIFEST,
    META,
    MANIFEST_KEY,
    CheckpointError,
    check_checkpoint,
    is_complete,
    latest_checkpoint,
    load_meta,
    load_rank_state,
    load_sharded,
    read_dcp_metadata,
    resolve_resume,
    rng_states,
    set_rng_states,
    verify,
)
from titan_lightning.config import CheckpointConfig


def _folder(tmp_path, name="epoch=0-step=5.ckpt", step=5, tensors=None, world_size=1):
    """A checkpoint folder as CheckpointWriter leaves it: shards, and meta.pt holding the manifest
    and every rank's state (Lightning's file set)."""
    path = tmp_path / name
    tensors = tensors or {"state_dict": {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}}
    dcp.save(tensors, checkpoint_id=str(path))
    ranks = [{"rng": rng_states(), "world_size": world_size} for _ in range(world_size)]
    torch.save({"global_step": step, MANIFEST_KEY: {"format": FORMAT, "global_step": step, "world_size": world_size,
                                                    "ranks": ranks}}, path / META)
    return path


def _folder_v1(tmp_path, name="epoch=0-step=5.ckpt", step=5, world_size=1):
    """A checkpoint folder of the first format (manifest in checkpoint.json, rank<r>.pt files): still read."""
    path = tmp_path / name
    dcp.save({"state_dict": {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}}, checkpoint_id=str(path))
    torch.save({"global_step": step}, path / META)
    for rank in range(world_size):
        torch.save({"rng": rng_states(), "world_size": world_size}, path / f"rank{rank}.pt")
    (path / MANIFEST).write_text(json.dumps({"format": "titan_lightning/1", "global_step": step,
                                             "world_size": world_size}))
    return path


class Payload:
    """Unpickling this runs code: it writes ``marker``. No load below may let it run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_complete_checkpoint_loads_in_place(tmp_path):
    path = _folder(tmp_path)
    state = {"state_dict": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}}
    load_sharded(path, state)
    assert torch.equal(state["state_dict"]["w"], torch.arange(6.0).view(2, 3))


def test_missing_keys_and_shapes_are_named(tmp_path):
    path = _folder(tmp_path)
    with pytest.raises(CheckpointError, match=r"does not match this run: 1 keys missing \(state_dict.extra\)"):
        check_checkpoint(path, {"state_dict": {"w": torch.zeros(2, 3), "extra": torch.zeros(1)}})
    with pytest.raises(CheckpointError, match=r"shapes differ \(state_dict.w: saved \(2, 3\), model \(3, 3\)\)"):
        check_checkpoint(path, {"state_dict": {"w": torch.zeros(3, 3)}})


def test_incomplete_truncated_and_absent_checkpoints_are_named(tmp_path):
    path = _folder(tmp_path)
    (path / META).unlink()
    with pytest.raises(CheckpointError, match=rf"{path} does not point to a valid checkpoint: not complete \(no "
                                              rf"manifest of titan_lightning in meta.pt\)"):
        verify(path)
    torch.save({"global_step": 5}, path / META)  # Lightning's meta.pt, no manifest of ours
    with pytest.raises(CheckpointError, match=rf"{path} does not point to a valid checkpoint"):
        verify(path)
    old = _folder_v1(tmp_path / "v1")
    (old / META).unlink()
    with pytest.raises(CheckpointError, match=rf"checkpoint {old}: meta.pt is missing \(saved by 1 ranks\)"):
        verify(old)
    other = _folder(tmp_path, "epoch=0-step=6.ckpt", 6)
    (shard,) = other.glob("*.distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[:10])
    with pytest.raises(CheckpointError, match=rf"shard file {shard.name} is truncated \(10 of \d+ bytes\)"):
        load_sharded(other, {"state_dict": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}})
    # Same length, garbage inside: reading fails, and says so with the folder's name.
    shard.write_bytes(bytes(len(data)))
    with pytest.raises(CheckpointError, match=r"reading the shards failed .* may be truncated"):
        load_sharded(other, {"state_dict": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}})
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"shard file {shard.name} is missing"):
        check_checkpoint(other, {})
    with pytest.raises(CheckpointError, match=r"does not exist"):
        check_checkpoint(tmp_path / "nope", {})


def test_latest_is_the_highest_complete_step(tmp_path):
    _folder(tmp_path / "a", "epoch=0-step=5.ckpt", 5)
    newest = _folder(tmp_path / "b", "epoch=0-step=10.ckpt", 10)
    broken = _folder(tmp_path / "b", "epoch=0-step=15.ckpt.partial", 15)
    assert not is_complete(broken)
    assert latest_checkpoint(tmp_path) == newest
    assert resolve_resume("latest", tmp_path) == str(newest)
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("latest", tmp_path / "a" / "empty") is None  # nothing yet: start fresh
    with pytest.raises(CheckpointError, match=r"resume_from='/no/such' does not exist"):
        resolve_resume("/no/such", tmp_path)
    with pytest.raises(CheckpointError, match=r"does not point to a valid checkpoint: .*the newest is .*step=10.ckpt"):
        resolve_resume(str(tmp_path / "b"), tmp_path)  # a folder of checkpoints, not one


def test_a_missing_or_corrupt_rank_or_meta_file_is_named(tmp_path):
    ours = _folder(tmp_path / "v2", world_size=2)
    manifest = verify(ours)
    assert load_rank_state(ours, 1, manifest)["world_size"] == 2
    meta = torch.load(ours / META, weights_only=True)
    meta[MANIFEST_KEY]["ranks"].pop()
    torch.save(meta, ours / META)
    with pytest.raises(CheckpointError, match=rf"checkpoint {ours}: meta.pt holds the states of 1 ranks, saved by 2"):
        verify(ours)
    path = _folder_v1(tmp_path, world_size=2)  # the first format: a file per rank
    (path / "rank1.pt").unlink()
    with pytest.raises(CheckpointError, match=rf"checkpoint {path}: rank1.pt is missing \(saved by 2 ranks\)"):
        verify(path)
    (path / "rank0.pt").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match=rf"checkpoint file {path / 'rank0.pt'} is unreadable"):
        load_rank_state(path, 0)
    (path / META).write_bytes(bytes(range(256)))
    with pytest.raises(CheckpointError, match=rf"checkpoint file {path / META} is unreadable"):
        load_meta(path)
    (path / DCP_METADATA).write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=rf"checkpoint {path}: cannot read .metadata"):
        read_dcp_metadata(path)


# -- no load runs code from the files ------------------------------------------------------


def test_a_malicious_meta_or_rank_file_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    path = _folder(tmp_path)
    torch.save({"global_step": 5, "evil": Payload(marker), MANIFEST_KEY: {"format": FORMAT, "global_step": 5,
                                                                         "world_size": 1, "ranks": []}}, path / META)
    with pytest.raises(CheckpointError, match=r"meta.pt holds (builtins.)?exec, which a weights-only load refuses"):
        load_meta(path)
    with pytest.raises(CheckpointError, match=r"does not point to a valid checkpoint"):
        verify(path)  # (its manifest is in the refused file)
    old = _folder_v1(tmp_path / "v1")
    torch.save({"rng": Payload(marker)}, old / "rank0.pt")
    with pytest.raises(CheckpointError, match=r"rank0.pt holds (builtins.)?exec"):
        load_rank_state(old, 0)
    assert not marker.exists()


def test_a_malicious_dcp_metadata_or_item_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    path = _folder(tmp_path)
    (path / DCP_METADATA).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"cannot read .metadata .*refused global builtins.exec"):
        check_checkpoint(path, {})
    # A non-tensor item inside a shard (DCP pickles those with torch.save): read weights-only.
    other = _folder(tmp_path, "epoch=0-step=6.ckpt", 6, tensors={"state_dict": {"w": torch.ones(2), "x": Payload(marker)}})
    with pytest.raises(CheckpointError, match=r"reading the shards failed"):
        load_sharded(other, {"state_dict": {"w": torch.zeros(2), "x": None}})
    assert not marker.exists()


def test_latest_reads_only_manifests_and_never_loads_a_decoy(tmp_path):
    marker = tmp_path / "ran"
    newest = _folder(tmp_path / "run", "epoch=0-step=10.ckpt", 10)
    decoy = tmp_path / "run" / "epoch=0-step=99.ckpt"  # a planted meta.pt, no manifest
    decoy.mkdir()
    torch.save(Payload(marker), decoy / META)
    forged = tmp_path / "other" / "x"  # a manifest that is not JSON of ours
    forged.mkdir(parents=True)
    (forged / MANIFEST).write_bytes(pickle.dumps(Payload(marker)))
    assert latest_checkpoint(tmp_path) == newest
    assert not marker.exists()


def test_rng_states_round_trip():
    states = rng_states()
    first = torch.rand(3)
    set_rng_states(states)
    assert torch.equal(torch.rand(3), first)


@pytest.mark.parametrize("kwargs, message", [
    (dict(interval=0), r"checkpoint.interval=0 must be an integer >= 1, or None"),
    (dict(keep_latest_k=0), r"checkpoint.keep_latest_k=0 must be -1 \(keep all\) or >= 1"),
    (dict(export_format="onnx"), r"checkpoint.export_format='onnx' is not one of dcp, hf, or None"),
    (dict(export_dtype="float16"), r"checkpoint.export_dtype='float16' is not one of float32, bfloat16"),
    (dict(initial_load_format="pt"), r"checkpoint.initial_load_format='pt' is not one of dcp, hf"),
])
def test_checkpoint_config_names_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckpointConfig(**kwargs)


def test_keep_latest_k_ranks_checkpoints_by_step(tmp_path):
    from titan_lightning.trainer import checkpoint_callback
    from recipes.tests import features

    job = features.llama3_debugmodel().job
    job.checkpoint.interval, job.checkpoint.keep_latest_k = 5, 2
    callback = checkpoint_callback(job, tmp_path)
    assert (callback.save_top_k, callback.monitor, callback.mode) == (2, "step", "max")
    assert callback._every_n_train_steps == 5 and os.fspath(callback.dirpath) == os.fspath(tmp_path / "checkpoints")


def test_keep_latest_k_leaves_the_newest_checkpoints_of_a_run(tmp_path, monkeypatch):
    """One process, 6 steps, a checkpoint every 2 steps, the newest 2 kept (the older folders removed)."""
    from recipes.tests import features
    from titan_lightning.recipe import execute
    from titan_lightning.trainer import RUN_DIR_ENV, build_trainer

    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    run = features.llama3_debugmodel()
    run.trainer.update(max_steps=6, enable_checkpointing=True)
    run.job.checkpoint.interval, run.job.checkpoint.keep_latest_k = 2, 2
    execute("fit", run, build_trainer(run))
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]
    assert all(is_complete(tmp_path / "checkpoints" / name) for name in folders)
    assert latest_checkpoint(tmp_path).name == "epoch=0-step=6.ckpt"


def test_model_export_in_bf16_and_hugging_face(tmp_path, monkeypatch):
    """One process: a bf16 sharded export (weights only, no optimizer state) and a Hugging Face one."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from recipes.tests import features
    from titan_lightning.recipe import execute
    from titan_lightning.trainer import RUN_DIR_ENV, build_trainer

    for fmt in ("dcp", "hf"):
        monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / fmt))
        run = features.llama3_debugmodel()
        run.trainer["max_steps"] = 1
        run.job.checkpoint.export_format, run.job.checkpoint.export_dtype = fmt, "bfloat16"
        execute("fit", run, build_trainer(run))
    saved = FileSystemReader(str(tmp_path / "dcp" / "export")).read_metadata().state_dict_metadata
    weight = saved["state_dict.model.layers.0.attention.wq.weight"]
    assert weight.properties.dtype == torch.bfloat16 and tuple(weight.size) == (256, 256)
    assert not any(key.startswith("optimizer") for key in saved)
    hf = {}
    for file in (tmp_path / "hf" / "export_hf").glob("*.safetensors"):
        hf.update(load_file(str(file)))
    assert hf["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16 and "lm_head.weight" in hf


# -- checksums, checked before launch -------------------------------------------------------


def test_the_manifest_lists_every_file_with_its_size_and_crc32(tmp_path):
    """Computed while writing (no file is read back by the save), equal to the files' own."""
    import zlib

    from tests.unit_tests.cpu.checkpoint_folders import small_checkpoint

    path = small_checkpoint()
    files = verify(path)["files"]
    assert {p.name for p in path.iterdir()} == {DCP_METADATA, META, "__0_0.distcp"}  # Lightning's file set
    assert set(files) == {DCP_METADATA, "__0_0.distcp"}  # (meta.pt holds the manifest: its zip keeps its crc32s)
    for name, (size, crc) in files.items():
        data = (path / name).read_bytes()
        assert (size, crc) == (len(data), zlib.crc32(data)), name


def test_a_flipped_bit_is_named_unless_checksums_are_off_and_old_checkpoints_still_load(tmp_path):
    import shutil

    from tests.unit_tests.cpu.checkpoint_folders import byte_of, flip_bit, small_checkpoint

    path = shutil.copytree(small_checkpoint(), tmp_path / "copy")
    shard, offset = byte_of(path, "state_dict.model.layers.1.feed_forward.w2.weight")
    flip_bit(path / shard, offset)
    with pytest.raises(CheckpointError, match=rf"checkpoint.resume_from='{path}': {shard} is corrupt \(crc32 "):
        resolve_resume(str(path), tmp_path)
    assert resolve_resume(str(path), tmp_path, checksums=False) == str(path)  # sizes only
    # Saved before checksums were recorded: no "files" in the manifest; it resumes (and loads).
    meta = torch.load(path / META, weights_only=True)
    del meta[MANIFEST_KEY]["files"]
    torch.save(meta, path / META)
    assert resolve_resume(str(path), tmp_path) == str(path)
    weight = torch.zeros(2048, 64)
    load_sharded(path, {"state_dict": {"model.output.weight": weight}})
    assert weight.abs().sum() > 0
    # A manifest whose file list points outside its folder is refused, not followed.
    meta[MANIFEST_KEY]["files"] = {"../elsewhere": [1, 2]}
    torch.save(meta, path / META)
    with pytest.raises(CheckpointError, match=r"lists its files in a form not written here"):
        resolve_resume(str(path), tmp_path)


def test_a_flipped_bit_in_meta_pt_is_named(tmp_path):
    """meta.pt carries the manifest, so its own crc32s are the ones torch.save's zip records keep."""
    import shutil
    import zipfile

    from tests.unit_tests.cpu.checkpoint_folders import flip_bit, small_checkpoint

    path = shutil.copytree(small_checkpoint(), tmp_path / "copy")
    with zipfile.ZipFile(path / META) as archive:
        record = next(info for info in archive.infolist() if info.filename.endswith("data.pkl"))
        offset = record.header_offset + 30 + len(record.filename.encode()) + len(record.extra) + record.file_size // 2
    flip_bit(path / META, offset)
    with pytest.raises(CheckpointError, match=rf"checkpoint.resume_from='{path}': meta.pt is corrupt"):
        resolve_resume(str(path), tmp_path)


def test_sigterm_saves_one_checkpoint_and_the_resumed_run_logs_and_shows_its_steps(tmp_path, monkeypatch):
    """The recipe's defaults (no checkpoint.interval, validation on): SIGTERM after step 3 leaves one
    checkpoint of step 3 (none written again when fit ends); resumed with `latest`, the loggers get
    steps 4-5 at their own step numbers (3 and 4: Lightning logs step k at k - 1) and the progress bar
    keeps its total."""
    import csv
    import signal

    import lightning as L

    from recipes.llama3 import debugmodel
    from titan_lightning.callbacks.progress import StepProgressBar
    from titan_lightning.recipe import execute
    from titan_lightning.trainer import RUN_DIR_ENV, build_trainer
    from titan_lightning.testing.record import SignalAtStep

    class BarTotals(L.Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_start(self, trainer, *args):
            bar = next(c for c in trainer.callbacks if isinstance(c, StepProgressBar)).train_progress_bar
            self.seen.append((bar.n, bar.total))

        on_train_end = on_train_batch_start

    def run(name, *callbacks, resume=None):
        monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "llama3_debugmodel" / name))
        run = debugmodel()
        model, training = run.job.model, run.job.training
        model.dim, model.n_layers, model.n_heads, model.n_kv_heads = 64, 2, 4, 4
        training.seq_len, training.tokens_per_microbatch_per_dp_rank = 64, 128
        run.job.checkpoint.resume_from = resume
        run.trainer.update(max_steps=5, limit_val_batches=1, enable_model_summary=False,
                           callbacks=list(callbacks))
        execute("fit", run, build_trainer(run))
        with open(tmp_path / "llama3_debugmodel" / name / "csv" / "metrics.csv") as f:
            return [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]

    assert run("stopped", SignalAtStep(3, rank=0, signum=signal.SIGTERM)) == [0, 1, 2]
    folder = tmp_path / "llama3_debugmodel" / "stopped" / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["epoch=0-step=3.ckpt"]
    bar = BarTotals()
    assert run("resumed", bar, resume="latest") == [3, 4]
    assert bar.seen == [(3, 5), (4, 5), (5, 5)]  # before steps 4 and 5, at the end (was "3/?" ... "5/?")


# -- the save's instrumentation point (faults are injected through it, from testing/) -------


@pytest.fixture
def save_hook():
    from titan_lightning.checkpoint import hooks

    yield hooks.install
    hooks.install(None)


def _save(tmp_path, name):
    from titan_lightning.checkpoint import CheckpointWriter

    writer = CheckpointWriter()
    for step in (1, 2):
        writer.save({"state_dict": {"w": torch.ones(4)}, "global_step": step}, tmp_path / f"{name}{step}.ckpt",
                    rank=0, rank_state={"rng": rng_states()})


def test_a_save_calls_its_hook_at_each_moment_and_the_product_installs_none(tmp_path, save_hook):
    from titan_lightning.checkpoint import hooks

    assert hooks._hook is None  # (nothing in titan_lightning installs one)
    seen = []
    save_hook(lambda moment, *, save, storage=None: seen.append((moment, save, type(storage).__name__)))
    _save(tmp_path, "step")
    assert seen == [(moment, save, "_ChecksummingWriter" if moment == "files" else "NoneType")
                    for save in (1, 2) for moment in ("begin", "files", "written")]
    assert verify(tmp_path / "step2.ckpt")["global_step"] == 2


def test_an_injected_full_disk_fails_the_named_save_in_one_line_and_leaves_no_partial(tmp_path, save_hook):
    from titan_lightning.testing.faults import FAULT_ENV, install_from_env

    install_from_env({FAULT_ENV: "2:enospc"})
    with pytest.raises(CheckpointError) as failed:
        _save(tmp_path, "step")
    message = str(failed.value)
    assert message.startswith(f"saving checkpoint {tmp_path / 'step2.ckpt'} failed: [Errno 28] No space left on device")
    assert "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1.ckpt"] and verify(tmp_path / "step1.ckpt")
    with pytest.raises(ValueError, match="moment 'later' is not one of begin, files, written, enospc"):
        install_from_env({FAULT_ENV: "1:later"})
