"""Distributed checkpoints through Lightning's own flow (ModelCheckpoint, ``Trainer.save_checkpoint``,
``fit(ckpt_path=...)``), for every layout TitanStrategy builds.

A checkpoint is a folder::

    epoch=0-step=5.ckpt/
        .metadata, __<rank>_0.distcp   model and optimizer, sharded (torch.distributed.checkpoint)
        meta.pt                        the rest of Lightning's checkpoint (loops, LR schedulers, callbacks ...)
                                       and, under the key "titan_lightning", the completion manifest: step,
                                       world size, every shard's and .metadata's size and crc32 (computed
                                       while written), and what differs per rank (RNG states, the data
                                       module's position); written last

  Exactly the files Lightning's ModelParallelStrategy writes, so code that checks a folder's file set
  holds. (The first format, still read, kept the manifest in ``checkpoint.json`` and each rank's state
  in ``rank<r>.pt``.)

- Model and optimizer are saved by name (the unsplit module names, the optimizer state
  flattened per parameter), so a checkpoint loads on any other layout: another FSDP degree,
  TP, PP stages (each rank reads only its stages' keys). A DTensor whose shard is several pieces
  of the tensor (TP's ``colwise_fused``: [q_r; k_r; v_r]) is saved replicated, in the module's own
  rows, and each rank reads its pieces back out of it.
- A save is atomic: it is written to ``<name>.partial``, completed by meta.pt and
  renamed when every rank is done. A run killed at any moment of a save leaves the previous
  checkpoints intact and at most a ``.partial`` folder, which ``latest`` skips. A save that
  fails (disk full, permission denied) removes its ``.partial`` and raises one line naming
  the folder and the OS error, on every rank.
- ``async_save``: the tensors are staged to CPU memory, then written in a background thread
  while training goes on; its collectives run on a process group of their own (gloo), so they
  never interleave with training's. The manifest and the rename follow as soon as the write ends.
- Before a run starts from a checkpoint, every file the manifest lists is checked: present, of its
  size, and (``checkpoint.verify_checksums``, the default) of its crc32 (meta.pt by the crc32s its zip
  records keep), so a flipped bit in a weight or a truncated shard is named before launch instead of
  training a wrong model. A
  checkpoint saved before checksums were recorded is checked for its files and their sizes only.
- Loading runs no code from the files: ``meta.pt`` (and the first format's ``rank<r>.pt``) are read with
  ``torch.load(weights_only=True)``, DCP's pickled ``.metadata`` with an unpickler that admits
  only DCP's own metadata classes, and DCP's non-tensor items with ``weights_only=True``;
  ``latest`` reads only the manifests (meta.pt weights-only).

The rooms: ``files`` (the folder's names, its small files read without running code), ``rng``
(what differs per rank), ``manifest`` (complete or not, the newest, every file checked),
``dcp`` (DCP's files read safely, checks against a model, ``load_sharded``), ``placements``
(shards DCP cannot describe), ``sources`` (full weights into a sharded model, block by block),
``writer`` (``CheckpointWriter``: atomic, checksummed, sync or async saves), ``hooks`` (the one
instrumentation point of a save, for tests), ``errors`` (one-line failures).
"""

from titan_lightning.checkpoint.dcp import check_checkpoint, check_model_shapes, load_sharded, read_dcp_metadata
from titan_lightning.checkpoint.errors import (  # noqa: F401 (the strategy's save errors)
    CheckpointError,
    CheckpointIsADirectoryError,
    NotACheckpointError,
    _describe,
)
from titan_lightning.checkpoint.files import (DCP_METADATA, FORMAT, MANIFEST, MANIFEST_KEY, META, PARTIAL, load_meta,
                                              load_rank_state, rank_file)
from titan_lightning.checkpoint.manifest import (check_files, is_complete, is_lightning_sharded, latest_checkpoint,
                                                 read_manifest, resolve_resume, unfinished_checkpoints, verify)
from titan_lightning.checkpoint.placements import check_placements, dcp_saveable
from titan_lightning.checkpoint.rng import rng_states, set_rng_states
from titan_lightning.checkpoint.sources import Source, load_full_state_dict, load_sources, local_block
from titan_lightning.checkpoint.writer import CheckpointWriter, checkpoint_group, say

__all__ = [
    "DCP_METADATA", "FORMAT", "MANIFEST", "MANIFEST_KEY", "META", "PARTIAL", "CheckpointError", "CheckpointWriter", "Source",
    "check_checkpoint", "check_files", "check_model_shapes", "check_placements", "checkpoint_group", "dcp_saveable",
    "is_complete", "is_lightning_sharded", "latest_checkpoint", "load_full_state_dict", "load_meta",
    "load_rank_state", "load_sharded", "load_sources", "local_block", "rank_file", "read_dcp_metadata",
    "read_manifest", "resolve_resume", "rng_states", "say", "set_rng_states", "unfinished_checkpoints", "verify",
]
