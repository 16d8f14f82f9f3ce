"""Pipeline parallelism inside Lightning's training loop: the stages of one rank (cut by
``titan_lightning/parallel/pipeline.py``) run through ``torch.distributed.pipelining`` schedules
(GPipe, 1F1B, Interleaved1F1B, LoopedBFS, zero bubble ...) over the microbatches of every step.

How the LightningModule's own steps run on the stages:

- the first stage takes what the module feeds its model: a module that says it
  (``model_input(batch) -> (args, kwargs)``: CausalLMModule) is asked; for a module of one's
  own, the runner runs its step hook up to the model call (``PipelinePlan.model``'s forward
  raises once it has seen its arguments);
- the schedule splits that input into ``pp_microbatches`` and runs forward and backward;
- on the last stage, the schedule's loss function is the rest of the step on each
  microbatch's rows of the batch: a module's ``step_from_output(hook, output, batch) -> (loss,
  records)`` (CausalLMModule: its objective's loss, objectives/), or a module of one's own's
  step hook itself, with the model's forward answering the stage output and ``self.log``
  recorded;
- what the step logs is averaged over the microbatches and replayed
  on every rank after the step (values sent from the last stage), so the progress bar,
  loggers, checkpoint monitors and golden numerics see the same numbers everywhere
  (strategies/logs.py, which also averages what gradient accumulation logs without PP);
- the strategy returns the mean microbatch loss, detached: the schedule already ran
  backward, so Lightning's own backward is skipped. Lightning zeroes the gradients after
  ``training_step`` and before backward; the schedule's gradients are therefore set aside
  during that call and put back in ``backward`` (and the runner clears them itself before
  the first microbatch of an accumulation window).

Validation and test run a forward-only schedule the same way.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from titan_lightning._compat import pipeline_schedule_from_csv
from titan_lightning.config import ConfigError
from titan_lightning.parallel.grad_norm import clip_grad_norm_
from titan_lightning.parallel.pipeline import PipelinePlan, stage_autocast, stage_rank
from titan_lightning.steps import starts_optimizer_step
from titan_lightning.strategies.logs import average_records, local, mean, patched, record_logs, replay_records, to_device


class _Captured(Exception):
    """Raised by the model's forward on the first stage once it has seen its input."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("pipeline input captured")
        self.args, self.kwargs = args, kwargs


def _rows(batch: Any, index: Tensor, batch_size: int) -> Any:
    """The rows ``index`` of every [batch_size, ...] tensor in ``batch``."""

    def take(t: Tensor) -> Tensor:
        return t.index_select(0, index.to(t.device)) if t.dim() > 0 and t.shape[0] == batch_size else t

    return apply_to_collection(batch, Tensor, take)


class PipelineRunner:
    """One rank's stages and schedules, and the step logic that keeps ``training_step`` unchanged."""

    def __init__(
        self,
        module: Any,
        plan: PipelinePlan,
        stage_modules: list[nn.Module],
        local_stages: list[int],
        num_stages: int,
        pp_mesh: DeviceMesh,
        device: torch.device,
        *,
        schedule: str,
        microbatches: int,
        placement: str,
        schedule_csv: Optional[str] = None,
        stage_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.module = module
        self.plan = plan
        self.stage_modules = stage_modules
        self.local_stages = local_stages
        self.num_stages = num_stages
        self.pp_group = pp_mesh.get_group()
        self.pp_size = pp_mesh.size()
        self.device = device
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.placement = placement
        self.schedule_csv = schedule_csv
        # Ranks that hold the same stages (everything but pp); None when that is this rank alone.
        self.stage_group = stage_group
        self.last_rank = stage_rank(num_stages - 1, self.pp_size, placement)
        self.is_first = 0 in local_stages
        self.is_last = num_stages - 1 in local_stages
        self._schedules: dict[bool, Any] = {}
        self._started = False
        self._saved_buffers: list[tuple[Tensor, Tensor]] = []
        self._mode = "training_step"
        self._records: list[tuple[str, Any, dict]] = []
        self._outputs: list[Any] = []
        self._error: Optional[BaseException] = None
        self._batch: Any = None
        self._batch_size = 0
        self._batch_idx: Any = None
        self._extra: tuple = ()
        self._loss_scale = 1.0

    # -- schedule ------------------------------------------------------------------------

    def _build_schedule(self):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        stages = [
            PipelineStage(submodule, s, self.num_stages, self.device, group=self.pp_group)
            for submodule, s in zip(self.stage_modules, self.local_stages)
        ]
        for stage in stages:
            stage.forward_one_chunk = self._first_chunk_hook(stage.forward_one_chunk)
        if self.schedule_csv is not None:
            return pipeline_schedule_from_csv(stages, self.microbatches, self._loss_fn, self.schedule_csv)
        cls = get_schedule_class(self.schedule_name)
        if issubclass(cls, PipelineScheduleSingle):
            return cls(stages[0], self.microbatches, loss_fn=self._loss_fn, scale_grads=False)
        return cls(stages, self.microbatches, loss_fn=self._loss_fn, scale_grads=False)

    def schedule(self, train: bool):
        """The training schedule, or a second one over its own stages for forward-only steps:
        each infers its stage metadata once, instead of again at every train/eval switch."""
        if train not in self._schedules:
            self._schedules[train] = self._build_schedule()
        return self._schedules[train]

    def _first_chunk_hook(self, forward_one_chunk: Callable) -> Callable:
        """Mark where the real microbatches start. Before that, a new schedule infers its
        stages' shapes by running them (the last with the loss function) on uninitialized
        inputs; buffers that forward changed (MoE token counts) are put back."""

        def hooked(*args: Any, **kwargs: Any) -> Any:
            if not self._started:
                self._started = True
                for buffer, saved in self._saved_buffers:
                    buffer.copy_(saved)
                self._saved_buffers = []
            return forward_one_chunk(*args, **kwargs)

        return hooked

    # -- the loss function: the module's own step on the last stage ---------------------

    def _loss_fn(self, output: Any, index: Tensor) -> Tensor:
        if self._error is not None or not self._started:
            # not started: the schedule's one-time metadata inference, on uninitialized inputs
            return _zero_loss(output)
        try:
            result = self._rest_of_step(output, _rows(self._batch, index, self._batch_size))
        except Exception as error:  # reported on every rank after the step, so no rank waits forever
            self._error = error
            return _zero_loss(output)
        loss = result.get("loss") if isinstance(result, dict) else result
        if self._mode != "training_step":
            self._outputs.append(None if loss is None else local(loss).detach())
            return _zero_loss(output) if loss is None else loss
        if not isinstance(loss, Tensor):
            self._error = TypeError(
                f"{type(self.module).__name__}.training_step must return the loss tensor (or a dict with 'loss') "
                f"under pipeline parallelism; got {type(result).__name__}"
            )
            return _zero_loss(output)
        self._outputs.append(local(loss).detach())
        return loss * self._loss_scale

    def _rest_of_step(self, output: Any, mb: Any) -> Any:
        """The module's step after the model call, on the last stage's ``output`` for microbatch ``mb``;
        what it logs goes to the step's records."""
        module = self.module
        if _offers_steps(module, self._mode):
            result, records = module.step_from_output(self._mode, output, mb)
            self._records.extend(records)
            return result
        # A module of one's own: its step hook, the model answering the output, ``self.log`` recorded.
        model = getattr(module, self.plan.model)
        with patched(model, "forward", lambda *args, **kwargs: output), patched(module, "log", record_logs(self._records)):
            return getattr(module, self._mode)(mb, self._batch_idx, *self._extra)

    # -- a step ----------------------------------------------------------------------------

    def _pipeline_input(self, batch: Any, batch_idx: Any, extra: tuple, mode: str) -> tuple[tuple, dict]:
        if _offers_steps(self.module, mode):
            return self.module.model_input(batch)
        model = getattr(self.module, self.plan.model)

        def capture(*args: Any, **kwargs: Any) -> Any:
            raise _Captured(args, kwargs)

        try:
            with patched(model, "forward", capture), patched(self.module, "log", lambda *a, **k: None):
                getattr(self.module, mode)(batch, batch_idx, *extra)
        except _Captured as captured:
            return captured.args, captured.kwargs
        raise RuntimeError(
            f"{type(self.module).__name__}.{mode} never called its `{self.plan.model}`: pipeline parallelism "
            f"feeds the first stage with what {mode} passes to self.{self.plan.model}(...)"
        )

    def step(self, hook: str, args: tuple, kwargs: dict, *, precision: Any, training: Any, fsdp: bool,
             records: Optional[list] = None) -> Any:
        """The strategy's step hook ``hook`` under PP: ``run`` in the precision plugin's training
        context (for training_step) and each stage's autocast (``training``: the job's, or None)."""
        if kwargs:
            raise TypeError(f"pipeline parallelism passes the batch positionally to {hook}; got {sorted(kwargs)}")
        context = precision.train_step_context() if hook == "training_step" else nullcontext()
        with context, stage_autocast(training, fsdp, self.device.type):
            return self.run(hook, *args, records=records)

    def run(self, mode: str, batch: Any, batch_idx: Any, *extra: Any, records: Optional[list] = None) -> Any:
        """Run ``mode`` ("training_step", "validation_step", "test_step") of the module on one batch.

        The module's ``self.log`` calls, averaged over the microbatches, are replayed on this rank,
        or appended to ``records`` (name, value, options) when a list is given."""
        train = mode == "training_step"
        self._mode, self._batch, self._batch_idx, self._extra = mode, batch, batch_idx, extra
        self._records, self._outputs, self._error = [], [], None
        size = _batch_size(batch)
        self._batch_size = size
        if size % self.microbatches:
            raise ConfigError(
                f"the local batch of {size} samples does not split into parallelism.pp_microbatches="
                f"{self.microbatches}; use a batch size divisible by the microbatches"
            )
        trainer = self.module.trainer
        self._loss_scale = 1.0 / (self.microbatches * (trainer.accumulate_grad_batches if train else 1))
        args, kwargs = self._pipeline_input(batch, batch_idx, extra, mode) if self.is_first else ((), {})
        target = torch.arange(size, device=self.device) if self.is_last else None
        new = train not in self._schedules
        schedule = self.schedule(train)
        self._started = False
        if new:
            self._saved_buffers = [(b, b.detach().clone()) for m in self.stage_modules for b in m.buffers()]
        if train:
            if starts_optimizer_step(trainer, batch_idx):
                self.clear_grads()  # a new accumulation window (Lightning zeroes only after this step)
            schedule.step(*args, target=target, return_outputs=False, **kwargs)
            self.stash_grads()
        else:
            with torch.inference_mode(False), torch.no_grad():
                args = apply_to_collection(args, Tensor, lambda t: t.clone())
                kwargs = apply_to_collection(kwargs, Tensor, lambda t: t.clone())
                schedule.eval(*args, target=target, **kwargs)
        return self._finish(records)

    def _finish(self, records: Optional[list]) -> Any:
        payload = None
        if self.is_last:
            payload = {
                "error": None if self._error is None else (type(self._error), str(self._error)),
                "records": average_records(self._records),
                "loss": mean(self._outputs),
            }
        payload = self._broadcast(payload)
        if payload["error"] is not None:
            if self._error is not None:
                raise self._error
            kind, message = payload["error"]
            try:
                error = kind(message)
            except Exception:
                error = RuntimeError(message)
            raise error
        if records is not None:
            records.extend(payload["records"])
        else:
            replay_records(self.module, payload["records"], self.device)
        loss = payload["loss"]
        if loss is None:
            return None
        return to_device(loss, self.device)

    def _broadcast(self, payload: Any) -> Any:
        objects = [payload]
        dist.broadcast_object_list(objects, group=self.pp_group, group_src=self.last_rank,
                                   device=self.device if self.device.type != "cpu" else None)
        return objects[0]

    # -- gradients across Lightning's zero_grad ----------------------------------------

    def clear_grads(self) -> None:
        for p in self.parameters():
            p.grad = None

    def stash_grads(self) -> None:
        """Take the schedule's gradients off the parameters (Lightning's zero_grad comes next)."""
        self._stash = [(p, p.grad) for p in self.parameters()]
        for p, _ in self._stash:
            p.grad = None

    def restore_grads(self) -> None:
        for p, grad in getattr(self, "_stash", ()):
            if grad is None:
                continue
            p.grad = grad if p.grad is None else p.grad + grad
        self._stash = []

    def backward(self, strategy: Any, closure_loss: Tensor) -> Tensor:
        """The strategy's backward: the schedule ran backward inside training_step; its gradients
        go back (Lightning zeroed in between) and the strategy's and precision plugin's hooks
        run, but no second backward."""
        self.restore_grads()
        strategy.pre_backward(closure_loss)
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, strategy.lightning_module)
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, strategy.lightning_module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def parameters(self) -> Iterator[nn.Parameter]:
        seen = set()
        for stage in self.stage_modules:
            for p in stage.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p


def _offers_steps(module: Any, hook: str) -> bool:
    """Whether ``module`` splits the step hook ``hook`` at the model call itself (``model_input`` and
    ``step_from_output``, as CausalLMModule does), so nothing of it is replaced while it runs: not
    when a subclass changed ``hook`` below the class that splits it (its own hook runs instead)."""
    if not callable(getattr(module, "model_input", None)) or hook in vars(module):
        return False
    mro = type(module).__mro__
    splits = next((c for c in mro if "step_from_output" in vars(c)), None)
    runs = next((c for c in mro if hook in vars(c)), None)
    return splits is not None and runs is not None and issubclass(splits, runs)


def _zero_loss(output: Any) -> Tensor:
    tensors = [t for t in _flatten(output) if isinstance(t, Tensor) and t.is_floating_point()]
    total = sum(t.sum() for t in tensors)
    return total * 0.0


def _flatten(value: Any) -> list:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flatten(v)]
    return [value]


def _batch_size(batch: Any) -> int:
    sizes = {t.shape[0] for t in _flatten(batch) if isinstance(t, Tensor) and t.dim() > 0}
    if not sizes:
        raise ValueError("pipeline parallelism needs a batch with tensors to split into microbatches")
    return max(sizes)


def clip_across_stages(plugin: Any, pp_group: dist.ProcessGroup) -> None:
    """Lightning's ``gradient_clip_val`` clips by the norm of this rank's gradients only; under
    PP the norm must cover every stage (and every DTensor shard): the precision plugin clips by
    the global norm. It acts for a user's module only: a module whose ``configure_gradient_clipping``
    clips by itself (CausalLM: the norm over the stages, ``global_grad_norm``) never reaches the
    plugin. No other seam carries it: Lightning picks the plugin's class from the trainer's
    ``precision`` (for FSDPStrategy and DeepSpeed only, a class of the strategy's own), and the
    module's hook is the user's."""

    def clip_grad_by_norm(optimizer, clip_val) -> None:
        clip_grad_norm_(plugin.main_params(optimizer), clip_val, pp_group=pp_group)

    plugin.clip_grad_by_norm = clip_grad_by_norm
