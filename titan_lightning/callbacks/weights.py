"""Model weights in and out of a run: start from a Hugging Face or sharded checkpoint
(``checkpoint.initial_load_path``), export at the end of fit (``checkpoint.export_format``).

Both work on every layout: a load shards each full tensor locally (each pipeline rank
takes its stages' names), a sharded export is read by any layout, and a Hugging Face export
gathers the full tensors to rank 0 (under PP, each stage's part travels to rank 0 first).
"""

import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn

from titan_lightning.checkpoint import (
    DCP_METADATA,
    PARTIAL,
    CheckpointError,
    check_files,
    check_model_shapes,
    check_placements,
    dcp_saveable,
    load_sharded,
    read_manifest,
    say,
)
from titan_lightning.lora import base_only, has_adapters
from titan_lightning.lora.peft_import import load_peft_folder
from titan_lightning.lora.export import MergedState, peft_state, write_peft_folder
from titan_lightning.models.common.safetensors_io import (INDEX_FILE, SINGLE_FILE, split_shards, write_index,
                                                         write_shards)
from titan_lightning.pretrained import check_hf_folder, folder_adapter, write_hf_metadata

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# A LoRA run's hf export: the merged model, and its adapters as PEFT's folder in this subfolder.
ADAPTER_FOLDER = "adapter"


def _adapter(module: L.LightningModule, folder: Optional[Path] = None):
    """The module's Hugging Face state-dict adapter; to load ``folder``, tied as the folder is (its
    config.json read once per launch: pretrained.folder_adapter)."""
    adapter = folder_adapter(module, folder) if folder is not None else (
        module.state_dict_adapter() if hasattr(module, "state_dict_adapter") else None)
    if adapter is None:
        raise CheckpointError(f"{type(module).__name__} has no Hugging Face state-dict adapter (state_dict_adapter())")
    return adapter


def _pipeline(trainer: L.Trainer):
    return getattr(trainer.strategy, "pipeline", None)


def model_shapes(module: L.LightningModule) -> Optional[dict[str, tuple[int, ...]]]:
    """The LightningModule's model tensors as a checkpoint names them (``model.<name>``) with their
    global shapes, from the model built on the meta device (no memory, no init); None for a module
    that does not build its model itself (``build_model``)."""
    build = getattr(module, "build_model", None)
    if not callable(build):
        return None
    with torch.device("meta"):
        model = build()
    # (a model with adapters checkpoints them and not its frozen base: strategies/checkpoint_io.py)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad} if has_adapters(model) else set()
    return {f"model.{name}": tuple(tensor.shape) for name, tensor in model.state_dict().items() if name not in frozen}


def check_initial_weights(path: str, fmt: str, module: Optional[L.LightningModule] = None,
                          checksums: bool = True) -> None:
    """Before launch: ``checkpoint.initial_load_path`` is a folder of the format it claims (its
    index or metadata readable, no code run); a Hugging Face folder passes the one check of a folder
    (pretrained.check_hf_folder: ``module``'s model args, tensors and tokenizer); a folder of ours
    holds ``module``'s tensors with their shapes, its files whole (``checksums``: their crc32 too);
    one-line CheckpointError / ConfigError otherwise."""
    field = f"checkpoint.initial_load_path={path!r}"
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"{field} does not exist")
    if not folder.is_dir():
        raise CheckpointError(f"{field} is a file; give a folder ({'a Hugging Face model folder' if fmt == 'hf' else 'a sharded export or checkpoint'})")
    if fmt == "hf":
        if not (folder / SINGLE_FILE).is_file() and not (folder / INDEX_FILE).is_file():
            hint = "; it looks like a sharded checkpoint of ours: set checkpoint.initial_load_format=dcp" if (
                folder / DCP_METADATA).is_file() else ""
            raise CheckpointError(f"{field} holds no {SINGLE_FILE} or {INDEX_FILE} (initial_load_format=hf){hint}")
        if module is not None:
            check_hf_folder(path, module)
        return
    if not (folder / DCP_METADATA).is_file():
        hint = "; it looks like a Hugging Face folder: set checkpoint.initial_load_format=hf" if (
            (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()) else ""
        raise CheckpointError(f"{field} holds no {DCP_METADATA} (initial_load_format=dcp: a sharded export or "
                              f"checkpoint){hint}")
    check_files(folder, read_manifest(folder), what=field, checksums=checksums)  # (an export has no manifest)
    shapes = model_shapes(module) if module is not None else None
    if shapes is not None:
        check_model_shapes(folder, shapes, field)


def check_export(module: L.LightningModule, fmt: Optional[str]) -> None:
    """Before launch: an ``hf`` export of ``module`` has an adapter to write it with. (What the
    family's export can hold is its own rule, run by ``validate_job``: ``check_config``.)"""
    if fmt == "hf":
        _adapter(module)


class LoadWeights(L.Callback):
    """Load the model weights (no optimizer state) from ``path``: a Hugging Face safetensors folder
    (``fmt="hf"``) or a sharded folder of ours (a model export or a full checkpoint, ``fmt="dcp"``).
    A fit loads them before its first step (on_fit_start); a resumed fit keeps its checkpoint's; a
    model with adapters (LoRA) loads its frozen base from the Hugging Face folder, fresh or resumed
    (its checkpoints hold the adapters alone), and a fresh one its adapters from ``lora.init_from``'s
    PEFT folder when the job names one. ``validate``, ``test`` and ``predict`` load them as the model
    is made (CausalLMModule.materialize), before Lightning restores their ``ckpt_path``, if any, over
    them: a command on the folder alone evaluates the folder's weights."""

    def __init__(self, path: str, fmt: str = "dcp") -> None:
        self.path, self.fmt = Path(path), fmt
        # Whether this fit resumes a checkpoint, as the recipe resolved it (``execute``): under
        # ModelParallelStrategy-style strategies Lightning restores the checkpoint after on_fit_start,
        # so ``trainer.ckpt_path`` is still None here (None: read it anyway). A resumed LoRA run then
        # never reads ``lora.init_from`` (its checkpoint holds the adapters). The starting weights are
        # still loaded first (the checkpoint replaces them; a preference run's frozen or precomputed
        # reference is made of them before the restore).
        self.resuming: Optional[bool] = None

    def loads_base(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        """Whether every parameter of the base will be loaded before it is read (the loads are strict;
        a pipeline rank's, of its stages): by on_fit_start in a fresh fit or one with adapters; by
        the module's materialize in the other commands. A module's materialize asks before it draws
        the random init, and skips those parameters' draw if so."""
        if trainer.state.fn != TrainerFn.FITTING:
            return trainer.state.fn in (TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING)
        return not self._resuming(trainer) or has_adapters(pl_module.model)

    def _resuming(self, trainer: L.Trainer) -> bool:
        return self.resuming if self.resuming is not None else trainer.ckpt_path is not None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        adapters = has_adapters(pl_module.model)
        # (a module whose init skipped the base's draw is loaded even so: a fit resumed with no
        # resuming said, where Lightning restores after this hook, replaces the values it loads)
        if trainer.ckpt_path is not None and not adapters and not getattr(pl_module, "init_skipped", False):
            return
        partial = _pipeline(trainer) is not None
        adapter = self.load(pl_module, partial=partial)
        if self.fmt == "hf":
            lora = getattr(getattr(pl_module, "job", None), "lora", None)
            if adapters and not self._resuming(trainer) and getattr(lora, "init_from", None) is not None:
                load_peft_folder(pl_module.model, adapter, Path(lora.init_from), partial=partial)

    def load(self, pl_module: L.LightningModule, *, partial: bool):
        """Load the weights of ``path`` into ``pl_module`` (``partial``: a pipeline rank's stages take
        the keys they hold); the family's Hugging Face adapter for ``fmt="hf"``, else None."""
        if not self.path.exists():
            raise CheckpointError(f"checkpoint.initial_load_path={str(self.path)!r} does not exist")
        if self.fmt == "hf":
            adapter = _adapter(pl_module, self.path)
            with base_only(pl_module.model) as base:
                adapter.load_into(base, self.path, partial=partial)
            return adapter
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        state = {"state_dict": get_model_state_dict(pl_module)}
        load_sharded(self.path, state)
        set_model_state_dict(pl_module, state["state_dict"], options=StateDictOptions(strict=True))
        return None


class ExportWeights(L.Callback):
    """At the end of fit, the model weights only, in ``dtype``, to ``folder``: sharded ("dcp",
    loadable by LoadWeights on any layout) or Hugging Face safetensors with an index ("hf")."""

    def __init__(self, folder: Path, fmt: str = "dcp", dtype: str = "float32") -> None:
        self.folder, self.fmt, self.dtype = Path(folder), fmt, _DTYPES[dtype]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Rank 0's folder on every rank (as ModelCheckpoint does with its dirpath): under torchrun or
        # srun each rank named its run folder from its own start time, and every rank writes shards here.
        self.folder = Path(trainer.strategy.broadcast(str(self.folder)))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if any(getattr(callback, "preempted", None) for callback in trainer.callbacks):
            return  # stopped by SIGTERM: the run is not over, its restart exports
        check_finite = getattr(pl_module, "check_finite", None)  # (CausalLMModule: the last step's values)
        if check_finite is not None:
            check_finite("before exporting the weights")
        begun = time.monotonic()
        say(f"export ({self.fmt}, {str(self.dtype).removeprefix('torch.')}) to {self.folder}: writing")
        if self.fmt == "dcp":
            self._export_sharded(trainer, pl_module)
        else:
            self._export_hf(trainer, pl_module)
        say(f"export to {self.folder}: done ({time.monotonic() - begun:.1f} s)")

    def _export_sharded(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = {k: v.detach().to(self.dtype) if v.is_floating_point() else v
                 for k, v in get_model_state_dict(pl_module).items()}
        staging = self.folder.with_name(self.folder.name + PARTIAL)
        if trainer.is_global_zero:
            shutil.rmtree(staging, ignore_errors=True)
        trainer.strategy.barrier()
        dcp.save({"state_dict": dcp_saveable(state)}, checkpoint_id=str(staging))
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            torch.save({"global_step": trainer.global_step, "export_dtype": str(self.dtype)}, staging / "meta.pt")
            shutil.rmtree(self.folder, ignore_errors=True)
            staging.rename(self.folder)
        trainer.strategy.barrier()

    def _export_hf(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Every rank writes safetensors files of its share of the tensors (each full tensor
        gathered, one at a time, by the ranks that hold it), rank 0 the index and the metadata:
        no rank ever holds the whole model."""
        adapter = _adapter(pl_module)
        own = pl_module.model.state_dict()
        check_placements(own.items())
        adapters = has_adapters(pl_module.model)
        if adapters:  # (the merged weights, each computed as the export reaches it)
            own = MergedState(pl_module.model)
        staging = self.folder.with_name(self.folder.name + PARTIAL)
        if trainer.is_global_zero:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        trainer.strategy.barrier()
        share = _my_share(own, adapter, self.dtype)
        write_hf_shards(share, staging)
        job = getattr(pl_module, "job", None)
        if adapters:  # (gathered on every rank, written by rank 0; a pipeline's stages each hold theirs)
            state = peft_state(pl_module.model, adapter, self.dtype)
            if _pipeline(trainer) is not None:
                state = _union_on_rank_zero(state)
            if trainer.is_global_zero:
                write_peft_folder(staging / ADAPTER_FOLDER, state, job.lora, job.checkpoint.initial_load_path, adapter)
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            if job is not None:
                c = job.checkpoint
                write_hf_metadata(staging, adapter, str(self.dtype).removeprefix("torch."), job.data.tokenizer_path,
                                  model_folder=c.initial_load_path if c.initial_load_format == "hf" else None)
            shutil.rmtree(self.folder, ignore_errors=True)
            staging.rename(self.folder)
        trainer.strategy.barrier()


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def _union_on_rank_zero(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's ``state`` in one dict on rank 0 (empty elsewhere); a key held by several ranks
    holds the same tensor on each."""
    rank, world = _world()
    if world == 1:
        return state
    states: Optional[list[Any]] = [None] * world if rank == 0 else None
    dist.gather_object(state, states, dst=0)
    return {key: value for each in states for key, value in each.items()} if states is not None else {}


def _my_share(own: dict[str, torch.Tensor], adapter: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors this rank writes: each group of our tensors (``export_group``: one
    key, or those fused into one Hugging Face tensor) goes to one of the ranks that hold it (round
    robin over the groups); a DTensor is gathered by its mesh, one tensor at a time."""
    from torch.distributed.tensor import DTensor

    rank, world = _world()
    group = adapter.export_group
    keys_by_rank: list[Any] = [list(own)]
    if world > 1:
        keys_by_rank = [None] * world
        dist.all_gather_object(keys_by_rank, list(own))
    holders: dict[str, dict[int, None]] = {}
    for holder, keys in enumerate(keys_by_rank):
        for key in keys:
            holders.setdefault(group(key), {})[holder] = None
    owner = {g: list(ranks)[i % len(ranks)] for i, (g, ranks) in enumerate(holders.items())}
    members = Counter(group(key) for key in own)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    share: dict[str, torch.Tensor] = {}
    for key, value in own.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        g = group(key)
        if owner[g] == rank:
            full = full.detach().to("cpu", dtype) if full.is_floating_point() else full.detach().cpu()
            pending.setdefault(g, {})[key] = full
            if len(pending[g]) == members[g]:
                share.update(adapter.to_hf(pending.pop(g)))
    return share


def write_hf_shards(share: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """Every rank's ``share`` into numbered safetensors files of ``folder`` (at most
    ``max_shard_bytes`` each, numbered across ranks) and the index; one file, ``model.safetensors``,
    when everything fits in one."""
    rank, world = _world()
    shards = split_shards(share, max_shard_bytes)
    counts: list[Any] = [len(shards)]
    if world > 1:
        counts = [None] * world
        dist.all_gather_object(counts, len(shards))
    total = sum(counts)
    weight_map = write_shards(shards, folder, first=sum(counts[:rank]), total=total)
    mine = (weight_map, sum(t.nbytes for shard in shards for t in shard.values()))
    parts: Any = [mine]
    if world > 1:
        parts = [None] * world if rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
    if rank == 0 and total > 1:
        write_index(folder, dict(sorted(kv for part, _ in parts for kv in part.items())),
                    sum(size for _, size in parts))
