"""TitanStrategy: N-D parallelism (FSDP2/HSDP/DDP, TP, CP, PP, EP) as one Lightning strategy.

The strategy owns the device mesh, applies the parallelisms in their fixed order
(titan_lightning/parallel/parallelize.py), then materializes the meta-device model with its
deterministic init. The LightningModule's code is the same on every layout; under PP the
strategy runs the schedule (see titan_lightning/strategies/pipeline.py).

Degrees come from the module's ``job.parallelism`` when it has one (every titan_lightning
model does), else from the strategy's own arguments: ``TitanStrategy(dp_shard=2, tp=2)``.
"""

import os
import shutil
import signal
import sys
import weakref
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel

from titan_lightning import checkpoint as ckpt
from titan_lightning._compat import ChildProcessObserver as _ChildProcessObserver
from titan_lightning._compat import default_group
from titan_lightning._compat import SubprocessScriptLauncher as _SubprocessScriptLauncher
from titan_lightning._compat import distributed_is_initialized as _distributed_is_initialized
from titan_lightning._compat import materialize_distributed_module as _materialize_distributed_module
from titan_lightning._compat import optimizers_to_device as _optimizers_to_device
from titan_lightning._compat import set_num_threads_if_needed as _set_num_threads_if_needed
from titan_lightning.checkpoint import CheckpointError
from titan_lightning.config import CommConfig, ConfigError, JobConfig, ParallelismConfig, TrainingConfig, validate_job
from titan_lightning.config.training import DTYPES
from titan_lightning.config.validation import (
    validate_degrees,
    validate_lightning_sizes,
    validate_pipeline_plan,
    validate_strategy,
    validate_tp_plan,
)
from titan_lightning.parallel.determinism import set_determinism
from titan_lightning.parallel.float8 import precompute_float8_scales
from titan_lightning.parallel.fsdp import OutsideCalls, find_repeated_blocks
from titan_lightning.parallel.grad_norm import clip_grad_norm_
from titan_lightning.parallel.heartbeat import Heartbeat, output_target
from titan_lightning.parallel.mesh import Mesh, ParallelDims, release_dtensor_caches
from titan_lightning.parallel.parallelize import Parallelized, parallelize
from titan_lightning.parallel.pipeline import describe_split, stage_autocast
from titan_lightning.parallel.tensor import FUSED, check_tp_plan
from titan_lightning.parallel.watchdog import Watchdog, process_group_timeout, set_comm_environment
from titan_lightning.steps import ends_optimizer_step
from titan_lightning.strategies.pipeline import PipelineRunner, average_records, patched, record_logs, replay_records


def _accumulating(trainer: L.Trainer, batch_idx: Optional[int]) -> bool:
    """Whether this batch is not the last of its optimizer step (Lightning's own rule when it has one)."""
    if batch_idx is None:
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
    return not ends_optimizer_step(trainer, batch_idx)


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


def _parallelizes_itself(module: L.LightningModule) -> bool:
    """Whether the module has a ``configure_model`` of its own: code written for Lightning's
    ModelParallelStrategy applies TP (and FSDP) there, so a TP degree needs no ``tp_plan``."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return is_overridden("configure_model", module, parent=L.LightningModule)


def _applied_by_user(module: torch.nn.Module) -> tuple[bool, bool]:
    """(FSDP, TP) the module's own configure_model already applied: any ``fully_shard`` module;
    DTensor parameters on a tensor-parallel mesh dim (or any DTensor parameter without FSDP)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    fsdp = any(isinstance(m, FSDPModule) for m in module.modules())
    tp = False
    for param in module.parameters():
        if isinstance(param, DTensor):
            names = param.device_mesh.mesh_dim_names or ()
            if not fsdp or any(n in ("tp", "tensor_parallel") for n in names):
                tp = True
                break
    return fsdp, tp


@contextmanager
def _nestable_loss_parallel():
    """``loss_parallel()`` that a user's own ``with loss_parallel():`` may nest in (torch's removes
    the loss handlers on exit, so the outer exit would fail with ``KeyError: aten._log_softmax``):
    on exit it removes only the handlers it added and that are still there."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss as torch_loss

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


class _Launcher(_SubprocessScriptLauncher):
    """Lightning's launcher (rank 0 starts ranks 1..n-1 as copies of its command), whose watch over
    the ranks it started says in one line which rank died, how, and where its output went."""

    def launch(self, function, *args: Any, trainer: Optional[L.Trainer] = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            self._observer = _RankObserver(main_pid=os.getpid(), child_processes=self.procs, sleep_period=1)
            self._observer.first_rank = self.cluster_environment.node_rank() * self.num_processes + 1
            self._observer.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def kill(self, signum) -> None:
        # Rank 0 is failing and stops the others itself: their exit is no news to report.
        if getattr(self, "_observer", None) is not None:
            self._observer.stopped = True
        super().kill(signum)


class _RankObserver(_ChildProcessObserver):
    first_rank = 1  # the global rank of the first process it watches (local rank 1 of this node)
    stopped = False  # set when rank 0 itself stops the ranks (it failed, or was interrupted)

    def _run(self) -> bool:
        if self.stopped:
            return True
        for proc in self._child_processes:
            proc.poll()
        if all(proc.returncode == 0 for proc in self._child_processes):
            return True
        for rank, proc in enumerate(self._child_processes, start=self.first_rank):
            if proc.returncode and not self.stopped:
                code = proc.returncode
                how = (f"was killed by {signal.Signals(-code).name} (the out-of-memory killer, a scheduler or a user)"
                       if code < 0 else f"exited with status {code} (its error is above)")
                print(f"titan-lightning: error: rank {rank} (pid {proc.pid}) {how}; its output: {output_target()}; "
                      f"stopping every rank", file=sys.stderr, flush=True)
                self._terminate_all()
                return True
        return False

    def _terminate_all(self) -> None:
        for proc in self._child_processes:
            proc.send_signal(self._termination_signal)
        os._exit(1)  # this (rank 0's) process too, with a failure status rather than a kill signal


class _Sharded:
    """What a run's parallelize made of a module, kept on the module (``_titan_sharded``): a later
    ``trainer.validate/test/fit`` of the same module in the same processes reuses its shards, mesh and
    hooks instead of sharding (and initializing) it again."""

    def __init__(self, dims: ParallelDims, mesh: Mesh, group: Any, state: tuple) -> None:
        # (the process group by weak reference: one destroyed since is not kept alive here)
        self.dims, self.mesh, self.state = dims, mesh, state
        self._group = weakref.ref(group) if group is not None else lambda: None

    @property
    def group(self) -> Any:
        return self._group()

    @staticmethod
    def of(module: torch.nn.Module, dims: ParallelDims) -> Optional["_Sharded"]:
        sharded = getattr(module, "_titan_sharded", None)
        if sharded is None:
            return None
        group = default_group() if _distributed_is_initialized() else None
        if sharded.dims != dims or sharded.group is not group:
            now = f"for {dims.describe()}" if sharded.dims != dims else "in a new process group"
            raise ConfigError(
                f"{type(module).__name__} was sharded by an earlier run in this process for {sharded.dims.describe()} "
                f"and cannot be sharded again {now}: build a new {type(module).__name__} (and load the checkpoint)")
        return sharded


class TitanStrategy(ModelParallelStrategy):
    """Composable N-D parallelism for any LightningModule.

    Args:
        parallelism: degrees and options; mutually exclusive with keyword degrees.
        mixed_precision_param, mixed_precision_reduce: FSDP dtypes for modules without a
            ``job`` (titan_lightning modules take them from ``job.training``).
        **degrees: fields of ``ParallelismConfig`` (``dp_shard=2, tp=2``).
    """

    strategy_name = "titan"
    # CausalLMModule leaves the meta-device model for the strategy to shard, then materialize.
    materializes_model = True

    def __init__(
        self,
        parallelism: Optional[ParallelismConfig] = None,
        *,
        mixed_precision_param: str = "float32",
        mixed_precision_reduce: str = "float32",
        data_parallel_size: Union[str, int, None] = None,
        tensor_parallel_size: Union[str, int, None] = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        **degrees: Any,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if parallelism is not None and degrees:
            raise ValueError("TitanStrategy takes either parallelism=ParallelismConfig(...) or degrees, not both")
        # ModelParallelStrategy's sizes: FSDP over data_parallel_size ranks, TP over tensor_parallel_size.
        self._lightning_sizes = None
        if data_parallel_size is not None or tensor_parallel_size is not None:
            if parallelism is not None or degrees:
                raise ValueError(
                    f"{type(self).__name__} takes either ModelParallelStrategy's data_parallel_size/"
                    f"tensor_parallel_size or its own degrees ({', '.join(sorted(degrees)) or 'parallelism'}), not both"
                )
            for name, size in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
                if size is not None and size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                    raise ValueError(f"{type(self).__name__}({name}={size!r}): expected a positive int or 'auto'")
            self._lightning_sizes = (data_parallel_size or "auto", tensor_parallel_size or "auto")
        for name, value in (("mixed_precision_param", mixed_precision_param), ("mixed_precision_reduce", mixed_precision_reduce)):
            if value not in DTYPES:
                raise ValueError(f"TitanStrategy({name}={value!r}): expected one of {', '.join(DTYPES)}")
        self._parallelism = parallelism if parallelism is not None else (ParallelismConfig(**degrees) if degrees else None)
        self._mixed_precision = (mixed_precision_param, mixed_precision_reduce)
        self.dims: Optional[ParallelDims] = None
        self.mesh: Optional[Mesh] = None
        self.pipeline: Optional[PipelineRunner] = None
        self._applied = Parallelized()  # what parallelize applied (the CP handle, FSDP roots, ...)
        self._checked = None  # the module check_module validated
        self._sync_last_roots: list = []
        self._outside_calls: list[OutsideCalls] = []
        # What training_step logged in the microbatches of the optimizer step so far.
        self._window: list = []
        self._checkpoint_writer = ckpt.CheckpointWriter()
        self.heartbeat: Optional[Heartbeat] = None
        self.watchdog: Optional[Watchdog] = None

    # -- configuration ---------------------------------------------------------------------

    # Degrees this strategy applies; the single-parallelism strategies narrow it.
    scope = ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")
    # Under the fake process group: no pipeline parallelism, no DDP (parallelize's ddp=False).
    fake_pg = False

    def parallelism(self, module: Optional[L.LightningModule] = None) -> ParallelismConfig:
        """The degrees in force: the module's job if it has one, else the strategy's own."""
        job = getattr(module if module is not None else self.lightning_module, "job", None)
        if job is not None:
            return job.parallelism
        return self._parallelism if self._parallelism is not None else self.default_parallelism()

    def default_parallelism(self) -> ParallelismConfig:
        """Degrees without a job or explicit ones: FSDP over every rank."""
        return ParallelismConfig()

    def _job(self, module: L.LightningModule) -> JobConfig:
        """The module's job; for a module without one, the strategy's degrees and precision."""
        job = getattr(module, "job", None)
        if job is not None:
            return job
        param, reduce = self._mixed_precision
        return JobConfig(parallelism=self.parallelism(module),
                         training=TrainingConfig(mixed_precision_param=param, mixed_precision_reduce=reduce))

    def _configure_launcher(self) -> None:
        self._check_own_degrees(self.num_nodes * self.num_processes)
        super()._configure_launcher()
        if isinstance(self._launcher, _SubprocessScriptLauncher):
            self._launcher = _Launcher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _check_own_degrees(self, world_size: int) -> None:
        """In Trainer.__init__, before any process is spawned: the strategy's own degrees (a module's
        job is validated with the module, by check_module)."""
        if self._lightning_sizes is not None:
            data_parallel, tensor_parallel = self._lightning_sizes
            # "auto" is the number of nodes (data parallel) and the devices of one node (tensor parallel).
            dp = self.num_nodes if data_parallel == "auto" else data_parallel
            tp = self.num_processes if tensor_parallel == "auto" else tensor_parallel
            validate_lightning_sizes(type(self).__name__, data_parallel, tensor_parallel, dp, tp, world_size)
            self._data_parallel_size, self._tensor_parallel_size = dp, tp
            self._parallelism = ParallelismConfig(dp_shard=dp, tp=tp)
        own = self._parallelism if self._parallelism is not None else self.default_parallelism()
        if own != ParallelismConfig():  # (the defaults, FSDP over every rank, fit any world)
            validate_degrees(own, world_size, fake_pg=self.fake_pg)

    def check_module(self, module: L.LightningModule, max_steps: Optional[int] = None) -> None:
        """Everything checked before launch once the module is known, once: its job
        (``validate_job``, the schedule too given ``max_steps``), the strategy's degrees against
        it, and the plans the module must declare for them. ``build_trainer`` calls it; for a
        Trainer built by hand, ``setup_environment`` does."""
        if module is self._checked:
            return
        config, job, name = self.parallelism(module), getattr(module, "job", None), type(module).__name__
        if job is not None:
            validate_job(job, world_size=self.world_size, max_steps=max_steps, fake_pg=self.fake_pg,
                         device_type=self.root_device.type)
        validate_strategy(type(self).__name__, self.scope, config, self._parallelism if job is not None else None)
        if config.tp > 1 and not _parallelizes_itself(module):
            plan = getattr(module, "tp_plan", None)
            validate_tp_plan(name, config, self.world_size, plan, FUSED)
            if not hasattr(module, "materialize"):  # a user's module: its network exists already
                check_tp_plan(module, plan, config.tp, sequence_parallel=config.sequence_parallel)
        validate_pipeline_plan(name, config, getattr(module, "pipeline_plan", None))
        self._checked = module

    # -- process groups and mesh -----------------------------------------------------------

    def setup_environment(self) -> None:
        self._failed = False  # (a strategy may run again after a fit that raised)
        self.check_module(self.lightning_module)  # (done already when build_trainer built the Trainer)
        comm, traces = self._comm()
        set_comm_environment(comm, traces, self._get_process_group_backend())
        if self._timeout == default_pg_timeout:  # (a timeout passed to the strategy wins)
            self._timeout = process_group_timeout(comm)
        self._setup_distributed()
        release_dtensor_caches()  # (sharding decisions cached against the meshes of a process group gone since)
        self.dims = ParallelDims.from_config(self.parallelism(), self.world_size)
        sharded = _Sharded.of(self.lightning_module, self.dims)
        if sharded is not None:  # fit, then validate/test/fit again: the module keeps its shards and mesh
            self.mesh = sharded.mesh
        else:
            # ModelParallelStrategy's sizes given: its mesh names too (code written for it asserts them).
            self.mesh = self.dims.build_mesh(self.root_device.type, lightning_names=self._lightning_sizes is not None)
        self._device_mesh = self.mesh.device_mesh
        self._checkpoint_writer = ckpt.CheckpointWriter(ckpt.checkpoint_group())
        self.heartbeat = Heartbeat.from_env()  # names a rank that dies (see parallel/heartbeat.py)
        self.watchdog = Watchdog.from_env(comm, traces, steps=lambda: self.lightning_module.trainer.global_step,
                                          ignore=[self._checkpoint_writer.group], on_hang=self._on_hang)
        self.lightning_module._device_mesh = self._device_mesh
        self._set_determinism()

    def _comm(self) -> tuple[CommConfig, Path]:
        """The module's ``job.comm`` (torchtitan's defaults without a job) and where a hang's traces go."""
        job = getattr(self.lightning_module, "job", None)
        try:
            root = Path(self.lightning_module.trainer.default_root_dir)
        except RuntimeError:  # not attached to a Trainer
            root = Path.cwd()
        return (job.comm if job is not None else CommConfig()), root / "comm_traces"

    def _on_hang(self) -> None:
        # The watchdog names a hung rank (parallel/watchdog.py) and every rank leaves: no news for the launcher.
        if getattr(self._launcher, "_observer", None) is not None:
            self._launcher._observer.stopped = True

    def _set_determinism(self) -> None:
        # Only modules that carry a job (every titan_lightning model) say how to seed.
        job = getattr(self.lightning_module, "job", None)
        if job is None:
            return
        pp_rank, pp = self.mesh.rank_and_size("pp")
        self._determinism = set_determinism(
            job.training.seed, deterministic=job.training.deterministic, device_type=self.root_device.type,
            pp_rank=pp_rank, pp=pp, cpu_threads=job.training.cpu_threads,
        )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Ranks that must see different batches: the data-parallel ones (TP/CP ranks share)."""
        rank, size = self.mesh.rank_and_size("dp")
        return {"num_replicas": size, "rank": rank}

    # -- model -----------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer) -> None:
        self.accelerator.setup(trainer)
        self.parallelize(self.lightning_module)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self.pipeline is not None:
            self._clip_across_stages()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def parallelize(self, module: L.LightningModule) -> None:
        """parallel.parallelize (PP split, TP, CP, EP, AC, compile, FSDP/DDP), then materialize."""
        dims, config = self.dims, self.parallelism(module)
        sharded = _Sharded.of(module, dims)
        if sharded is not None and sharded.mesh is self.mesh:  # (sharded and materialized by an earlier run)
            self._applied, self._sync_last_roots, self._module_is_root, self._outside_calls, self.pipeline = sharded.state
            return
        inner = getattr(module, "model", None) if hasattr(module, "materialize") else None
        # What the module's own configure_model already applied (code written for Lightning's
        # ModelParallelStrategy does its TP and FSDP there) stays as the user made it.
        user_fsdp, user_tp = _applied_by_user(module)
        plan = getattr(module, "tp_plan", None)
        if dims.tp_enabled and not user_tp and _parallelizes_itself(module):  # (check_module left TP to it)
            if self._lightning_sizes is None or plan is not None:
                validate_tp_plan(type(module).__name__, config, self.world_size, plan, FUSED)
            elif self.global_rank == 0:  # ModelParallelStrategy's contract: TP is the module's own business
                print(f"[parallelize] tensor_parallel_size={dims.tp}: {type(module).__name__}.configure_model applied "
                      f"no tensor parallelism and it declares no tp_plan; its parameters are replicated over the "
                      f"{dims.tp} tensor-parallel ranks", flush=True)
        blocks = None if inner is not None else find_repeated_blocks(module)
        self._applied = applied = parallelize(
            module, self.mesh, self._job(module), model=inner, tp_plan=None if user_tp else plan, blocks=blocks,
            pipeline_plan=getattr(module, "pipeline_plan", None), fsdp=not user_fsdp, ddp=not self.fake_pg)
        split = applied.pipeline
        if split is not None and self.global_rank == 0:
            print(f"[pipeline] {describe_split(split.names, config, split.placement)}", flush=True)
        if self.global_rank == 0:
            for note in applied.notes:
                print(f"[parallelize] {note}", flush=True)
        # Roots whose gradient sync follows the accumulation window (under PP the schedule does it).
        self._sync_last_roots = applied.fsdp_roots if config.fsdp_sync_last_microbatch_only and split is None else []
        # The LightningModule itself as FSDP's (or DDP's) root: see _call_step.
        self._module_is_root = inner is None and split is None and not user_fsdp and (
            dims.fsdp_enabled or dims.dp_replicate_enabled)
        if inner is not None:
            module.materialize(self.root_device)
        else:
            _materialize_distributed_module(module, self.root_device)
        # A submodule called outside a step hook (a Lightning hook, a callback, the user's script
        # after fit) gathers the root's parameters as the root's forward would (parallel/fsdp.py).
        for calls in self._outside_calls:
            calls.remove()
        self._outside_calls = [] if split is not None else [
            OutsideCalls(root) for root in applied.fsdp_roots if isinstance(root, FSDPModule)]
        if split is not None:
            stage_mesh = self.mesh.get("stage")
            self.pipeline = PipelineRunner(
                module, module.pipeline_plan, split.stages, split.local, len(split.names), self.mesh.get("pp"),
                self.root_device, schedule=config.pp_schedule, microbatches=config.pp_microbatches,
                placement=split.placement, schedule_csv=config.pp_schedule_csv,
                stage_group=None if stage_mesh is None else stage_mesh.get_group(),
            )
        module._titan_sharded = _Sharded(dims, self.mesh, default_group() if
                                         _distributed_is_initialized() else None,
                                         (applied, self._sync_last_roots, self._module_is_root, self._outside_calls,
                                          self.pipeline))

    def _clip_across_stages(self) -> None:
        """Lightning's ``gradient_clip_val`` clips by the norm of this rank's gradients only; under
        PP the norm must cover every stage (and every DTensor shard): clip by the global norm."""
        plugin, group = self.precision_plugin, self.pipeline.pp_group

        def clip_grad_by_norm(optimizer, clip_val) -> None:
            clip_grad_norm_(plugin.main_params(optimizer), clip_val, pp_group=group)

        plugin.clip_grad_by_norm = clip_grad_by_norm

    @property
    def loss_parallel_enabled(self) -> bool:
        """Our plan's vocab-sharded logits go into the loss (a module that applied its own TP
        enters ``loss_parallel()`` itself, as with ModelParallelStrategy)."""
        return self._applied.loss_parallel

    def _loss_parallel(self):
        return _nestable_loss_parallel() if self.loss_parallel_enabled else nullcontext()

    def _shard_sequence(self, args: tuple) -> tuple:
        """Under CP, each rank keeps its slice of every [B, S, ...] tensor of the batch (dim 1)."""
        cp = self._applied.cp
        if cp is None or not args:
            return args
        batch = args[0]
        if isinstance(batch, dict):
            batch = {k: cp.shard(v) if isinstance(v, Tensor) and v.dim() >= 2 else v for k, v in batch.items()}
        elif isinstance(batch, Tensor) and batch.dim() >= 2:
            batch = cp.shard(batch)
        return (batch, *args[1:])

    def _step(self, hook: str, args: tuple, kwargs: dict, records: Optional[list] = None) -> Any:
        args = self._shard_sequence(args)
        with self._loss_parallel():
            if self.pipeline is None:
                if records is None:
                    return self._call_step(hook, args, kwargs)
                with patched(self.lightning_module, "log", record_logs(records)):
                    return self._call_step(hook, args, kwargs)
            if kwargs:
                raise TypeError(f"pipeline parallelism passes the batch positionally to {hook}; got {sorted(kwargs)}")
            context = self.precision_plugin.train_step_context() if hook == "training_step" else nullcontext()
            job = getattr(self.lightning_module, "job", None)
            training = job.training if job is not None else None
            with context, stage_autocast(training, self.dims.fsdp_enabled, self.root_device.type):
                return self.pipeline.run(hook, *args, records=records)

    def _call_step(self, hook: str, args: tuple, kwargs: dict) -> Any:
        """Run the module's step hook (no pipeline).

        When the LightningModule itself is FSDP's (or DDP's) root, the hook runs inside the
        root's forward: FSDP gathers the root's own parameters (whatever no block holds: an
        embedding, a head, parameters of the LightningModule itself) in the root's pre-forward
        hook, and DDP prepares its gradient reduction in the root's post-forward hook. A
        training_step that calls a submodule directly (``self.model(x)``, ``self.encoder(...)``,
        the usual Lightning pattern) never runs ``self.forward``, so without this the root's
        parameters stay sharded ("mixed torch.Tensor and DTensor") and DDP never reduces.

        The alternative, sharding each submodule as a root of its own, breaks on parameters of
        the LightningModule itself, on submodules called in any order or from several places,
        and changes nothing the user sees; the redirection is Lightning's own (its DDP and FSDP
        strategies route steps through their wrapper's forward the same way), and ``self(x)``
        inside the hook is an ordinary nested call.
        """
        context = {
            "training_step": self.precision_plugin.train_step_context,
            "validation_step": self.precision_plugin.val_step_context,
            "test_step": self.precision_plugin.test_step_context,
            "predict_step": self.precision_plugin.predict_step_context,
        }[hook]
        if not getattr(self, "_module_is_root", False):
            return getattr(super(), hook)(*args, **kwargs)
        with context():
            return self._forward_redirection(self.model, self.lightning_module, hook, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's training_step (through the pipeline schedule under PP). With several
        microbatches per optimizer step (gradient accumulation, or PP microbatches), what the
        module logs is averaged over the step's microbatches and logged once, at its last:
        ``train/loss`` is the step's loss, as with one big batch."""
        trainer = self.lightning_module.trainer
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
        self._set_gradient_sync(batch_idx)
        if trainer.accumulate_grad_batches == 1 and self.pipeline is None:
            return self._step("training_step", args, kwargs)
        records: list = []
        loss = self._step("training_step", args, kwargs, records=records)
        self._window += average_records(records)
        if not _accumulating(trainer, batch_idx):
            window, self._window = average_records(self._window), []
            replay_records(self.lightning_module, window, self.root_device)
        return loss

    def _set_gradient_sync(self, batch_idx: Optional[int]) -> None:
        """``parallelism.fsdp_sync_last_microbatch_only``: FSDP reduces gradients only on the last
        microbatch of an accumulation window (under PP the schedule does this per stage itself)."""
        if not self._sync_last_roots or batch_idx is None:
            return
        last = not _accumulating(self.lightning_module.trainer, batch_idx)
        for root in self._sync_last_roots:
            root.set_requires_gradient_sync(last)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            raise NotImplementedError("predict under pipeline parallelism is not supported; predict with pp=1")
        return self._call_step("predict_step", args, kwargs)

    def backward(self, closure_loss: Tensor, optimizer, *args: Any, **kwargs: Any) -> Tensor:
        if self.pipeline is not None:
            # The schedule ran backward inside training_step; put its gradients back (Lightning
            # zeroed in between) and run the hooks, but no second backward.
            self.pipeline.restore_grads()
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
            closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
            self.post_backward(closure_loss)
            return closure_loss
        # Loss parallel needs its context around backward too, not only the loss.
        with self._loss_parallel():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        """The step, then what float8 does after it: with FSDP's float8 all-gather and
        ``precompute_float8_dynamic_scale_for_fsdp``, every weight's scale in one all-reduce."""
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        f8 = self._job(self.lightning_module).quantize.float8
        if self._applied.float8 and self._applied.fsdp_roots and f8.precompute_float8_dynamic_scale_for_fsdp:
            for root in self._applied.fsdp_roots:
                precompute_float8_scales(root)
        return result

    # -- checkpoints -------------------------------------------------------------------------

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name (flattened per parameter), so each pipeline
        stage saves its own and a checkpoint loads on another layout."""
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if not self._save_distributed_checkpoint:
            # As ModelParallelStrategy: the whole state on rank 0, keyed as a plain optimizer's
            # state_dict() (parameter indices), so torch.optim loads it without this project.
            full = get_optimizer_state_dict(self.model, optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return _names_to_indices(full, self.model, optimizer) if self.global_rank == 0 else {}
        options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=False)
        state = get_optimizer_state_dict(self.model, optimizer, options=options)
        if self.pipeline is None:
            # Also the param groups as ModelParallelStrategy saves them (a list; small values), so
            # that it resumes from this checkpoint too. Under PP each stage has groups of its own:
            # only the flattened ones (per parameter) say which is which.
            # (built from the optimizer's groups: asking torch for the nested state would rebuild all of it)
            names = {id(param): _clean_name(name) for name, param in self.model.named_parameters()}
            state["param_groups"] = [{**{k: v for k, v in group.items() if k != "params"},
                                      "params": [names[id(param)] for param in group["params"]]}
                                     for group in optimizer.param_groups]
        return state

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's shards (DTensors); with ``save_distributed_checkpoint=False`` the full
        tensors on rank 0 (empty elsewhere), as ModelParallelStrategy."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = not self._save_distributed_checkpoint
        if full:  # (a sharded save checks its DTensors itself)
            ckpt.check_placements(self.model.named_parameters())
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=full, cpu_offload=full))

    def _rank_state(self) -> dict[str, Any]:
        """What this rank alone knows: its RNG states and its data module's position."""
        state: dict[str, Any] = {"rng": ckpt.rng_states(), "world_size": self.world_size,
                                 "layout": self.dims.describe() if self.dims is not None else None}
        datamodule = getattr(self.lightning_module.trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "state_dict"):
            state["datamodule"] = datamodule.state_dict()
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Sharded, atomic save (see titan_lightning/checkpoint.py); asynchronous when the job says so."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        from pathlib import Path

        path = Path(self.broadcast(str(filepath)))
        if not self._save_distributed_checkpoint:
            self._save_full(checkpoint, path)
            return
        job = getattr(self.lightning_module, "job", None)
        async_save = bool(job is not None and job.checkpoint.async_save)
        trainer = self.lightning_module.trainer
        last = trainer.should_stop or 0 < (trainer.max_steps or 0) <= trainer.global_step  # (nothing else shows)
        self._checkpoint_writer.save(checkpoint, path, rank=self.global_rank, rank_state=self._rank_state(),
                                     async_save=async_save, announce=last)

    def _save_full(self, checkpoint: dict[str, Any], path) -> None:
        """One file written by rank 0 (``torch.load(path)["state_dict"]`` loads into a plain module),
        under a temporary name until complete."""
        writer = self._checkpoint_writer
        writer.wait()

        def write() -> None:
            if self.global_rank != 0:
                return
            if path.is_dir():
                if not ckpt.is_complete(path):
                    raise CheckpointError(f"{path} is a folder that is not a checkpoint; not replacing it with a file")
                shutil.rmtree(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ckpt.PARTIAL)
            torch.save(checkpoint, partial)
            os.replace(partial, path)

        writer.agree(write, lambda error: f"saving checkpoint {path} failed: {ckpt._describe(error, folder=path.parent)}")

    def _load_full(self, path, weights_only: bool) -> dict[str, Any]:
        """A single-file (full) checkpoint into the sharded model and optimizers: every rank maps
        the file and keeps its own shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        checkpoint = self._checkpoint_writer.agree(
            lambda: torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only))
        strict = self.lightning_module.strict_loading
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        states = checkpoint.pop("optimizer_states", [])
        if self.optimizers and len(states) != len(self.optimizers):
            raise CheckpointError(f"checkpoint {path} holds {len(states)} optimizer state(s); this run has "
                                  f"{len(self.optimizers)} optimizer(s)")
        for optimizer, state in zip(self.optimizers, states):
            set_optimizer_state_dict(self.model, optimizer, _indices_to_names(state, self.model, optimizer), options=options)
        return checkpoint

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Model and optimizer from the shards (any layout), the rest from meta.pt, this rank's RNG
        and data position from its own file (when the checkpoint was saved by as many ranks).

        No file runs code: ``trainer.fit``'s ``weights_only`` set to False (for hyperparameters of
        your own types, in a checkpoint you trust) relaxes only Lightning's part, meta.pt."""
        from pathlib import Path

        writer = self._checkpoint_writer
        writer.wait()
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_file():
            ckpt.check_placements(self.model.named_parameters())
            return self._load_full(path, weights_only=weights_only is not False)
        if ckpt.is_lightning_sharded(path):
            return self._load_lightning_sharded(path, weights_only=weights_only is not False)
        manifest = writer.agree(lambda: ckpt.verify(path, ranks=False))
        same_world = manifest["world_size"] == self.world_size
        mine = writer.agree(lambda: ckpt.load_rank_state(path, self.global_rank) if same_world else None)
        checkpoint = writer.agree(lambda: ckpt.load_meta(path, weights_only=weights_only is not False))
        if not same_world and self.global_rank == 0:
            print(f"[checkpoint] {path} was saved by {manifest['world_size']} ranks, this run has {self.world_size}: "
                  f"RNG states start from training.seed, the data position is derived from the global sample count",
                  flush=True)
        self._load_states(path, flatten_optimizer_state_dict=True)
        if mine is not None:
            ckpt.set_rng_states(mine["rng"])
            datamodule = getattr(self.lightning_module.trainer, "datamodule", None)
            if datamodule is not None and "datamodule" in mine:
                checkpoint[type(datamodule).__qualname__] = mine["datamodule"]
        return checkpoint

    def _load_states(self, path, *, flatten_optimizer_state_dict: bool) -> None:
        """The model's and every optimizer's state from the DCP shards in ``path`` (any layout);
        optimizer state flattened per parameter (ours) or nested (Lightning's strategies)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        writer = self._checkpoint_writer
        options = StateDictOptions(flatten_optimizer_state_dict=flatten_optimizer_state_dict,
                                   strict=self.lightning_module.strict_loading)
        state: dict[str, Any] = {"state_dict": get_model_state_dict(self.model, options=options)}
        for index, optimizer in enumerate(self.optimizers):
            state[f"optimizer_{index}"] = get_optimizer_state_dict(self.model, optimizer, options=options)
        writer.agree(lambda: ckpt.load_sharded(path, state, group=writer.group))
        set_model_state_dict(self.model, state["state_dict"], options=options)
        for index, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(self.model, optimizer, state[f"optimizer_{index}"], options=options)

    def _load_lightning_sharded(self, path, weights_only: bool) -> dict[str, Any]:
        """A sharded checkpoint of Lightning's ModelParallelStrategy (DCP shards and meta.pt, no
        manifest): the model and optimizer states in its layout (optimizer state keyed by parameter
        name, not flattened); no RNG or data position (it saves none)."""
        writer = self._checkpoint_writer
        self._load_states(path, flatten_optimizer_state_dict=False)
        checkpoint = writer.agree(lambda: ckpt.load_meta(path, weights_only=weights_only))
        if self.global_rank == 0:
            print(f"[checkpoint] {path} was saved by Lightning's ModelParallelStrategy: model and optimizer "
                  f"restored; RNG states and the data position it does not save", flush=True)
        return checkpoint

    def remove_checkpoint(self, filepath) -> None:
        """keep_latest_k: an older checkpoint folder goes, never leaving a half-deleted one that looks whole."""
        from pathlib import Path

        path = Path(filepath)
        if path.is_file():  # a full checkpoint (save_distributed_checkpoint=False)
            if self.global_rank == 0:
                path.unlink()
            return
        self._checkpoint_writer.remove(path, rank=self.global_rank)

    # -- collectives -----------------------------------------------------------------------

    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        """Reduce over the data-parallel x CP ranks (TP ranks hold equal values) by default."""
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        if group is None:
            loss_mesh = self.mesh.get("dp_cp") if self.mesh is not None else None
            if loss_mesh is None:
                return tensor
            group = loss_mesh.get_group()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def on_exception(self, exception: BaseException) -> None:
        # A peer may be gone: teardown must not wait for it in a collective.
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        failed = getattr(self, "_failed", False)
        if not failed:
            self._checkpoint_writer.wait()  # an asynchronous save still being written
        if getattr(self, "heartbeat", None) is not None and not failed:
            self.heartbeat.stop()  # (after a failure it beats on: the peers are told who really died)
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.stop()
        super().teardown()
        if getattr(self, "_determinism", None) is not None:
            self._determinism.restore()
            self._determinism = None
        # The process group outlives the run, as under Lightning's own strategies: what comes after
        # ``trainer.fit`` (saving, ``lightning_module_state_dict()``, ``full_tensor()``, a second fit
        # or a test in the same processes, also after an exception the user caught) needs it. The
        # program that started it ends it (the CLI does, after its command, failed or not).
