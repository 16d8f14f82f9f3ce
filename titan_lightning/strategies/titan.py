"""TitanStrategy: N-D parallelism (FSDP2/HSDP/DDP, TP, CP, PP, EP) as one Lightning strategy.

It owns the device mesh, applies the parallelisms in their fixed order (parallel/parallelize.py),
then materializes the meta-device model with its deterministic init; the LightningModule's code is
the same on every layout. Degrees: the module's ``job.parallelism`` (every titan_lightning model
has one), else the strategy's own (``TitanStrategy(dp_shard=2, tp=2)``). Each hook hands its work
to a room: launcher.py (the ranks), sharding.py (mesh, parallelize, materialize), step_hooks.py and
logs.py (the steps), pipeline.py (the schedule under PP), checkpoint_io.py (checkpoints).
"""

from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from titan_lightning import checkpoint as ckpt
from titan_lightning._compat import distributed_is_initialized, optimizers_to_device
from titan_lightning.config import JobConfig, ParallelismConfig, validate_job
from titan_lightning.config.validation import (
    validate_degrees,
    validate_lightning_sizes,
    validate_strategy,
    validate_tp_plan,
)
from titan_lightning.parallel.contracts import check_contracts
from titan_lightning.parallel.heartbeat import Heartbeat
from titan_lightning.parallel.mesh import Mesh, ParallelDims
from titan_lightning.parallel.tensor import FUSED, check_tp_plan
from titan_lightning.parallel.watchdog import Watchdog
from titan_lightning.strategies import checkpoint_io, sharding, step_hooks
from titan_lightning.strategies.launcher import Comm, launcher, restore_comm, set_comm, stop_watch, watch
from titan_lightning.strategies.logs import StepLogs
from titan_lightning.strategies.pipeline import PipelineRunner, clip_across_stages


class TitanStrategy(ModelParallelStrategy):
    """Composable N-D parallelism for any LightningModule.

    Args:
        parallelism: degrees and options; mutually exclusive with keyword degrees.
        mixed_precision_param, mixed_precision_reduce: FSDP dtypes for modules without a
            ``job`` (titan_lightning modules take them from ``job.training``).
        timeout: for a module without a ``job``, how long a collective may wait before the run is
            ended as hung, naming the rank it waits for (the process groups' own timeout comes 60 s
            later); with a job, ``job.comm`` says that and this replaces the process groups' timeout.
        **degrees: fields of ``ParallelismConfig`` (``dp_shard=2, tp=2``).
    """

    strategy_name = "titan"
    # CausalLMModule leaves the meta-device model for the strategy to shard, then materialize.
    materializes_model = True
    # Degrees this strategy applies; the single-parallelism strategies narrow it.
    scope = ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")
    # Under the fake process group: no pipeline parallelism, no DDP (parallelize's ddp=False).
    fake_pg = False

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
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._mixed_precision = (mixed_precision_param, mixed_precision_reduce)
        self._parallelism, self._lightning_sizes = sharding.given_degrees(
            type(self).__name__, parallelism, degrees, data_parallel_size, tensor_parallel_size, self._mixed_precision)
        self.dims: Optional[ParallelDims] = None
        self.mesh: Optional[Mesh] = None
        self.sharded: Optional[sharding.Sharded] = None  # what parallelize made of the module
        self._checked = None  # the module check_module validated
        self.step_logs = StepLogs()
        self._checkpoint_writer = ckpt.CheckpointWriter()
        self._given_timeout = timeout  # (self._timeout becomes the process groups' own)
        self._comm: Optional[Comm] = None
        self.heartbeat: Optional[Heartbeat] = None
        self.watchdog: Optional[Watchdog] = None

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
        return sharding.job_of(module, self.parallelism(module), self._mixed_precision)

    @property
    def pipeline(self) -> Optional[PipelineRunner]:
        """This rank's pipeline stages and their schedules (None without PP)."""
        return self.sharded.pipeline if self.sharded is not None else None

    @override
    def _configure_launcher(self) -> None:
        self._check_own_degrees(self.num_nodes * self.num_processes)
        super()._configure_launcher()
        self._launcher = launcher(self._launcher, self.cluster_environment, self.num_processes, self.num_nodes)

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
        if config.tp > 1 and not sharding.parallelizes_itself(module):
            plan = getattr(module, "tp_plan", None)
            validate_tp_plan(name, config, self.world_size, plan, FUSED)
            if not hasattr(module, "materialize"):  # a user's module: its network exists already
                check_tp_plan(module, plan, config.tp, sequence_parallel=config.sequence_parallel)
        check_contracts(module, config, built=sharding.network_built(module))
        self._checked = module

    @override
    def setup_environment(self) -> None:
        module, self._failed = self.lightning_module, False  # (a strategy may run again after a fit that raised)
        self._check_own_degrees(self.world_size)  # (again: a cluster environment may say another world size)
        self.check_module(module)  # (done already when build_trainer built the Trainer)
        self._comm = set_comm(module, self._get_process_group_backend(), self._given_timeout, type(self).__name__)
        self._timeout = self._comm.timeout
        self._setup_distributed()
        self.dims, self.mesh = sharding.setup_mesh(module, self.parallelism(), self.world_size, self.root_device.type,
                                                   lightning_names=self._lightning_sizes is not None)
        self._device_mesh = module._device_mesh = self.mesh.device_mesh
        self._checkpoint_writer = ckpt.CheckpointWriter(ckpt.checkpoint_group())
        self.heartbeat, self.watchdog = watch(module, self._comm, ignore=[self._checkpoint_writer.group],
                                              launcher=lambda: self._launcher)
        if getattr(module, "job", None) is not None:  # (only modules with a job, as ours, say how to seed)
            self._determinism = sharding.seed(module.job, self.mesh, self.root_device.type)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Ranks that must see different batches: the data-parallel ones (TP/CP ranks share)."""
        rank, size = self.mesh.rank_and_size("dp")
        return {"num_replicas": size, "rank": rank}

    @override
    def setup(self, trainer: L.Trainer) -> None:
        sharding.refuse_fsdp1(self.model, type(self).__name__)  # (configure_model, run since check_module, may wrap)
        self.accelerator.setup(trainer)
        self.parallelize(self.lightning_module)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self.pipeline is not None:
            clip_across_stages(self.precision_plugin, self.pipeline.pp_group)
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def parallelize(self, module: L.LightningModule) -> None:
        """parallel.parallelize (PP split, TP, CP, EP, AC, compile, FSDP/DDP), then materialize."""
        dims, config = self.dims, self.parallelism(module)
        sharded = sharding.Sharded.of(module, dims)
        if sharded is not None and sharded.mesh is self.mesh:  # (sharded and materialized by an earlier run)
            self.sharded = sharded
            return
        # What the module's own configure_model already applied (code written for Lightning's
        # ModelParallelStrategy does its TP and FSDP there) stays as the user made it.
        user_fsdp, user_tp = sharding.applied_by_user(module)
        plan = getattr(module, "tp_plan", None)
        if dims.tp_enabled and not user_tp and sharding.parallelizes_itself(module):  # (check_module left TP to it)
            if self._lightning_sizes is None or plan is not None:
                validate_tp_plan(type(module).__name__, config, self.world_size, plan, FUSED)
            elif self.global_rank == 0:  # ModelParallelStrategy's contract: TP is the module's own business
                print(f"[parallelize] tensor_parallel_size={dims.tp}: {type(module).__name__}.configure_model applied "
                      f"no tensor parallelism and it declares no tp_plan; its parameters are replicated over the "
                      f"{dims.tp} tensor-parallel ranks", flush=True)
        self.sharded = sharding.shard(module, self.mesh, self._job(module), self.root_device, rank=self.global_rank,
                                       tp_plan=None if user_tp else plan, user_fsdp=user_fsdp, ddp=not self.fake_pg,
                                       previous=self.sharded)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's training_step (through the pipeline schedule under PP). With several
        microbatches per optimizer step (gradient accumulation, or PP microbatches), what the
        module logs is averaged over the step's microbatches and logged once, at its last."""
        return step_hooks.training_step(self, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return step_hooks.step(self, "validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return step_hooks.step(self, "test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            raise NotImplementedError("predict under pipeline parallelism is not supported; predict with pp=1")
        return step_hooks.call_step(self, "predict_step", args, kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer, *args: Any, **kwargs: Any) -> Tensor:
        if self.pipeline is not None:  # (the schedule ran backward in training_step)
            return self.pipeline.backward(self, closure_loss)
        with sharding.loss_parallel_context(self.sharded):  # (around backward too, not only the loss)
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        sharding.after_optimizer_step(self.sharded, self._job(self.lightning_module))
        return result

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return checkpoint_io.optimizer_state(self.model, optimizer, full=not self._save_distributed_checkpoint,
                                             rank=self.global_rank, pipeline=self.pipeline is not None)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return checkpoint_io.model_state(self.model, full=not self._save_distributed_checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        checkpoint_io.save(self._checkpoint_writer, checkpoint, Path(self.broadcast(str(filepath))),
                           self.lightning_module, full=not self._save_distributed_checkpoint, rank=self.global_rank,
                           world_size=self.world_size, layout=self.dims.describe() if self.dims is not None else None)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """No file runs code: ``trainer.fit``'s ``weights_only`` set to False (for hyperparameters of
        your own types, in a checkpoint you trust) relaxes only Lightning's part, meta.pt."""
        self._checkpoint_writer.wait()
        return checkpoint_io.load(self._checkpoint_writer, Path(self.broadcast(str(checkpoint_path))), self.model,
                                  self.optimizers, self.lightning_module, rank=self.global_rank,
                                  world_size=self.world_size, weights_only=weights_only is not False)

    @override
    def remove_checkpoint(self, filepath) -> None:
        checkpoint_io.remove(self._checkpoint_writer, Path(filepath), rank=self.global_rank)

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        """Reduce over the data-parallel x CP ranks (TP ranks hold equal values) by default."""
        if not isinstance(tensor, Tensor) or not distributed_is_initialized():
            return tensor
        group = sharding.loss_group(self.mesh) if group is None else group
        return tensor if group is None else super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # a peer may be gone: teardown must not wait for it in a collective
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """The process group outlives the run, as under Lightning's own strategies: what comes after
        ``trainer.fit`` (saving, ``full_tensor()``, a second fit or a test in the same processes,
        also after an exception the user caught) needs it; the program that started it ends it."""
        failed = getattr(self, "_failed", False)
        if not failed:
            self._checkpoint_writer.wait()  # an asynchronous save still being written
        stop_watch(getattr(self, "heartbeat", None), getattr(self, "watchdog", None), failed=failed)
        restore_comm(getattr(self, "_comm", None))
        super().teardown()
        if getattr(self, "_determinism", None) is not None:
            self._determinism.restore()
            self._determinism = None
