"""What TitanStrategy does to a LightningModule between Lightning's hooks: the degrees it was
given, the device mesh, sharding (every parallelism through ``parallel.parallelize``) and
materializing the module, kept on the module (``Sharded``) so a later run of the same module
reuses it; and what the steps need of that: the batch's sequences sliced for CP, the loss in
``loss_parallel``, the seeds of this rank's place in the mesh, float8's scales after a step."""

import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss as torch_loss
from torch.distributed.tensor.parallel import loss_parallel

from titan_lightning._compat import default_group
from titan_lightning._compat import distributed_is_initialized as _distributed_is_initialized
from titan_lightning._compat import materialize_distributed_module as _materialize_distributed_module
from titan_lightning.config import ConfigError, JobConfig, ParallelismConfig, TrainingConfig
from titan_lightning.config.training import DTYPES
from titan_lightning.parallel.context import ContextParallel
from titan_lightning.parallel.determinism import set_determinism
from titan_lightning.parallel.float8 import precompute_float8_scales
from titan_lightning.parallel.fsdp import OutsideCalls, find_repeated_blocks
from titan_lightning.parallel.mesh import Mesh, ParallelDims, release_dtensor_caches
from titan_lightning.parallel.parallelize import Parallelized, parallelize
from titan_lightning.parallel.pipeline import describe_split
from titan_lightning.strategies.pipeline import PipelineRunner


def given_degrees(strategy: str, parallelism: Optional[ParallelismConfig], degrees: dict[str, Any],
                  data_parallel_size: Any, tensor_parallel_size: Any,
                  mixed_precision: tuple[str, str]) -> tuple[Optional[ParallelismConfig], Optional[tuple[Any, Any]]]:
    """What a strategy was given, checked: (its own degrees or None, ModelParallelStrategy's
    ``(data_parallel_size, tensor_parallel_size)`` or None). Those sizes (FSDP over the one, TP over
    the other; its mesh names too) are "auto" where one is left out, resolved at launch."""
    if parallelism is not None and degrees:
        raise ValueError("TitanStrategy takes either parallelism=ParallelismConfig(...) or degrees, not both")
    sizes = None
    if data_parallel_size is not None or tensor_parallel_size is not None:
        if parallelism is not None or degrees:
            raise ValueError(
                f"{strategy} takes either ModelParallelStrategy's data_parallel_size/"
                f"tensor_parallel_size or its own degrees ({', '.join(sorted(degrees)) or 'parallelism'}), not both"
            )
        for name, size in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
            if size is not None and size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise ValueError(f"{strategy}({name}={size!r}): expected a positive int or 'auto'")
        sizes = (data_parallel_size or "auto", tensor_parallel_size or "auto")
    for name, value in zip(("mixed_precision_param", "mixed_precision_reduce"), mixed_precision):
        if value not in DTYPES:
            raise ValueError(f"TitanStrategy({name}={value!r}): expected one of {', '.join(DTYPES)}")
    return (parallelism if parallelism is not None else (ParallelismConfig(**degrees) if degrees else None)), sizes


def job_of(module: L.LightningModule, parallelism: ParallelismConfig, mixed_precision: tuple[str, str]) -> JobConfig:
    """The module's job; for a module without one, the strategy's degrees and precision."""
    job = getattr(module, "job", None)
    if job is not None:
        return job
    param, reduce = mixed_precision
    return JobConfig(parallelism=parallelism,
                     training=TrainingConfig(mixed_precision_param=param, mixed_precision_reduce=reduce))


def parallelizes_itself(module: L.LightningModule) -> bool:
    """Whether the module has a ``configure_model`` of its own: code written for Lightning's
    ModelParallelStrategy applies TP (and FSDP) there, so a TP degree needs no ``tp_plan``."""
    return is_overridden("configure_model", module, parent=L.LightningModule)


def network_built(module: L.LightningModule) -> bool:
    """Whether the module's network exists before setup: neither built on the meta device at setup
    (``materialize``) nor by a ``configure_model`` of its own."""
    return not hasattr(module, "materialize") and not parallelizes_itself(module)


def refuse_fsdp1(module: torch.nn.Module, strategy: str) -> None:
    """A TypeError, as ModelParallelStrategy's, for modules wrapped by the legacy FSDP API (FSDP1):
    their flat parameters compose with none of the parallelisms here."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError(f"{strategy}: the module holds modules wrapped with torch.distributed.fsdp."
                        f"FullyShardedDataParallel (FSDP1); {strategy} only supports the new FSDP2 APIs in PyTorch "
                        f">= 2.4: shard them with fully_shard in configure_model, or leave the sharding to {strategy}")


def applied_by_user(module: torch.nn.Module) -> tuple[bool, bool]:
    """(FSDP, TP) the module's own configure_model already applied: any ``fully_shard`` module;
    DTensor parameters on a tensor-parallel mesh dim (or any DTensor parameter without FSDP)."""
    fsdp = any(isinstance(m, FSDPModule) for m in module.modules())
    tp = False
    for param in module.parameters():
        if isinstance(param, DTensor):
            names = param.device_mesh.mesh_dim_names or ()
            if not fsdp or any(n in ("tp", "tensor_parallel") for n in names):
                tp = True
                break
    return fsdp, tp


@dataclass(eq=False)
class Sharded:
    """What a run's parallelize made of a module, kept on the module (``_titan_sharded``): a later
    ``trainer.validate/test/fit`` of the same module in the same processes reuses its shards, mesh and
    hooks instead of sharding (and initializing) it again."""

    dims: ParallelDims
    mesh: Mesh
    applied: Parallelized = field(default_factory=Parallelized)  # the CP handle, FSDP roots, ...
    sync_last_roots: list = field(default_factory=list)  # roots whose gradient sync follows the accumulation window
    module_is_root: bool = False  # the LightningModule itself is FSDP's (or DDP's) root
    outside_calls: list[OutsideCalls] = field(default_factory=list)
    pipeline: Optional[PipelineRunner] = None
    _group: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # (the process group by weak reference: one destroyed since is not kept alive here)
        group = default_group() if _distributed_is_initialized() else None
        self._group = weakref.ref(group) if group is not None else lambda: None

    @staticmethod
    def of(module: torch.nn.Module, dims: ParallelDims) -> Optional["Sharded"]:
        sharded = getattr(module, "_titan_sharded", None)
        if sharded is None:
            return None
        group = default_group() if _distributed_is_initialized() else None
        if sharded.dims != dims or sharded._group() is not group:
            now = f"for {dims.describe()}" if sharded.dims != dims else "in a new process group"
            raise ConfigError(
                f"{type(module).__name__} was sharded by an earlier run in this process for {sharded.dims.describe()} "
                f"and cannot be sharded again {now}: build a new {type(module).__name__} (and load the checkpoint)")
        return sharded


def setup_mesh(module: L.LightningModule, config: ParallelismConfig, world_size: int, device_type: str, *,
               lightning_names: bool) -> tuple[ParallelDims, Mesh]:
    """The degrees over ``world_size`` ranks and their device mesh: a new one, or (fit, then
    validate/test/fit again) the one the module was sharded over. ``lightning_names``: the mesh
    dims named as ModelParallelStrategy names them (code written for it asserts them)."""
    release_dtensor_caches()  # (sharding decisions cached against the meshes of a process group gone since)
    dims = ParallelDims.from_config(config, world_size)
    sharded = Sharded.of(module, dims)
    return dims, sharded.mesh if sharded is not None else dims.build_mesh(device_type, lightning_names=lightning_names)


def shard(module: L.LightningModule, mesh: Mesh, job: JobConfig, device: torch.device, *, rank: int,
          tp_plan: Optional[dict], user_fsdp: bool, ddp: bool, previous: Optional[Sharded]) -> Sharded:
    """parallel.parallelize (PP split, TP, CP, EP, AC, compile, FSDP/DDP), then materialize; the
    result is kept on the module. ``tp_plan`` None: no TP here (none, or the module applied its own);
    ``user_fsdp``: the module's configure_model sharded it already; ``previous``: what the strategy
    sharded before (its hooks go)."""
    dims, config = mesh.dims, job.parallelism
    inner = getattr(module, "model", None) if hasattr(module, "materialize") else None
    blocks = None if inner is not None else find_repeated_blocks(module)
    applied = parallelize(module, mesh, job, model=inner, tp_plan=tp_plan, blocks=blocks,
                          pipeline_plan=getattr(module, "pipeline_plan", None), fsdp=not user_fsdp, ddp=ddp)
    split = applied.pipeline
    if split is not None and rank == 0:
        print(f"[pipeline] {describe_split(split.names, config, split.placement)}", flush=True)
    if rank == 0:
        for note in applied.notes:
            print(f"[parallelize] {note}", flush=True)
    sharded = Sharded(
        dims, mesh, applied,
        # (under PP the schedule syncs gradients per stage itself)
        sync_last_roots=applied.fsdp_roots if config.fsdp_sync_last_microbatch_only and split is None else [],
        # see step_hooks.call_step
        module_is_root=inner is None and split is None and not user_fsdp and (dims.fsdp_enabled or dims.dp_replicate_enabled))
    if inner is not None:
        module.materialize(device)
    else:
        _materialize_distributed_module(module, device)
    for calls in previous.outside_calls if previous is not None else ():
        calls.remove()
    if split is None:
        # A submodule called outside a step hook (a Lightning hook, a callback, the user's script
        # after fit) gathers the root's parameters as the root's forward would (parallel/fsdp.py).
        sharded.outside_calls = [OutsideCalls(root) for root in applied.fsdp_roots if isinstance(root, FSDPModule)]
    else:
        stage_mesh = mesh.get("stage")
        sharded.pipeline = PipelineRunner(
            module, module.pipeline_plan, split.stages, split.local, len(split.names), mesh.get("pp"),
            device, schedule=config.pp_schedule, microbatches=config.pp_microbatches,
            placement=split.placement, schedule_csv=config.pp_schedule_csv,
            stage_group=None if stage_mesh is None else stage_mesh.get_group(),
        )
    module._titan_sharded = sharded
    return sharded


def shard_sequence(cp: Optional[ContextParallel], args: tuple) -> tuple:
    """Under CP, each rank keeps its slice of every [B, S, ...] tensor of the batch (dim 1; S the
    longest dim 1 of the batch: a [B, k] tensor of another length, a window's preference slots, is
    whole on every rank)."""
    if cp is None or not args:
        return args
    batch = args[0]
    if isinstance(batch, dict):
        sequence = max((v.shape[1] for v in batch.values() if isinstance(v, Tensor) and v.dim() >= 2), default=0)
        batch = {k: cp.shard(v) if isinstance(v, Tensor) and v.dim() >= 2 and v.shape[1] == sequence else v
                 for k, v in batch.items()}
    elif isinstance(batch, Tensor) and batch.dim() >= 2:
        batch = cp.shard(batch)
    return (batch, *args[1:])


@contextmanager
def nestable_loss_parallel():
    """``loss_parallel()`` that a user's own ``with loss_parallel():`` may nest in (torch's removes
    the loss handlers on exit, so the outer exit would fail with ``KeyError: aten._log_softmax``):
    on exit it removes only the handlers it added and that are still there."""
    ops = getattr(torch_loss, "customized_loss_ops", None)
    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    if not isinstance(ops, dict) or not isinstance(handlers, dict):  # another torch: its own context
        with loss_parallel():
            yield
        return
    added = {op: handler for op, handler in ops.items() if handlers.get(op) is not handler}
    handlers.update(added)
    try:
        yield
    finally:
        for op, handler in added.items():
            if handlers.get(op) is handler:
                del handlers[op]


def loss_parallel_context(sharded: Optional[Sharded]):
    """Around a step and its backward: our plan's vocab-sharded logits go into the loss (a module
    that applied its own TP enters ``loss_parallel()`` itself, as with ModelParallelStrategy)."""
    return nestable_loss_parallel() if sharded is not None and sharded.applied.loss_parallel else nullcontext()


def seed(job: JobConfig, mesh: Mesh, device_type: str) -> Any:
    """``job.training``'s seed and determinism for this rank (each pipeline stage its own seeds);
    the handle that restores what was there before."""
    pp_rank, pp = mesh.rank_and_size("pp")
    return set_determinism(job.training.seed, deterministic=job.training.deterministic, device_type=device_type,
                           pp_rank=pp_rank, pp=pp, cpu_threads=job.training.cpu_threads)


def loss_group(mesh: Optional[Mesh]) -> Any:
    """The ranks a logged loss is averaged over: data-parallel x CP (TP ranks hold equal values)."""
    loss_mesh = mesh.get("dp_cp") if mesh is not None else None
    return None if loss_mesh is None else loss_mesh.get_group()


def after_optimizer_step(sharded: Sharded, job: JobConfig) -> None:
    """What float8 does after the step: with FSDP's float8 all-gather and
    ``precompute_float8_dynamic_scale_for_fsdp``, every weight's scale in one all-reduce."""
    applied = sharded.applied
    if applied.float8 and applied.fsdp_roots and job.quantize.float8.precompute_float8_dynamic_scale_for_fsdp:
        for root in applied.fsdp_roots:
            precompute_float8_scales(root)
