"""How TitanStrategy runs the module's step hooks on the sharded module: on this rank's slice of
the batch (CP), inside ``loss_parallel`` (TP's vocab-sharded logits), through the schedule under
PP, and inside the root's forward when the LightningModule itself is FSDP's (or DDP's) root; with
several microbatches per optimizer step, FSDP syncs gradients at the last one only (when asked)
and what the step logs is averaged over them (strategies/logs.py)."""

from contextlib import nullcontext
from typing import Any, Optional

from lightning.pytorch.strategies import ModelParallelStrategy

from titan_lightning.steps import ends_optimizer_step
from titan_lightning.strategies.logs import patched, record_logs
from titan_lightning.strategies.sharding import loss_parallel_context, shard_sequence

# The precision plugin's context around each step hook (as Lightning's own strategies enter it).
_CONTEXTS = {"training_step": "train_step_context", "validation_step": "val_step_context",
             "test_step": "test_step_context", "predict_step": "predict_step_context"}


def training_step(strategy: Any, args: tuple, kwargs: dict) -> Any:
    """The module's training_step; with several microbatches per optimizer step (PP microbatches,
    or gradient accumulation in a module with a ``job``), what it logs is logged once, at the step's
    last. A module of one's own under accumulation logs every microbatch, as Lightning's strategies do."""
    module, sharded = strategy.lightning_module, strategy.sharded
    trainer = module.trainer
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
    ends_step = ends_optimizer_step(trainer, trainer.fit_loop.epoch_loop.batch_idx if batch_idx is None else batch_idx)
    # parallelism.fsdp_sync_last_microbatch_only: FSDP reduces gradients on a window's last microbatch only.
    for root in sharded.sync_last_roots if batch_idx is not None else ():
        root.set_requires_gradient_sync(ends_step)
    if sharded.pipeline is None and (trainer.accumulate_grad_batches == 1 or getattr(module, "job", None) is None):
        return step(strategy, "training_step", args, kwargs)
    records: list = []
    loss = step(strategy, "training_step", args, kwargs, records=records)
    strategy.step_logs.add(records, strategy.lightning_module, strategy.root_device, ends_step=ends_step)
    return loss


def step(strategy: Any, hook: str, args: tuple, kwargs: dict, records: Optional[list] = None) -> Any:
    """A step hook on this rank's slice of the batch; ``records``: what it logs goes there."""
    sharded, module = strategy.sharded, strategy.lightning_module
    args = shard_sequence(sharded.applied.cp, args)
    with loss_parallel_context(sharded):
        if sharded.pipeline is not None:
            job = getattr(module, "job", None)
            return sharded.pipeline.step(hook, args, kwargs, precision=strategy.precision_plugin, records=records,
                                         training=job.training if job is not None else None,
                                         fsdp=strategy.dims.fsdp_enabled)
        with patched(module, "log", record_logs(records)) if records is not None else nullcontext():
            return call_step(strategy, hook, args, kwargs)


def call_step(strategy: Any, hook: str, args: tuple, kwargs: dict) -> Any:
    """The module's step hook (no pipeline), as Lightning's strategies call it; when the
    LightningModule itself is FSDP's (or DDP's) root, inside the root's forward.

    There FSDP gathers the root's own parameters (whatever no block holds: an embedding, a head,
    parameters of the LightningModule itself) in the root's pre-forward hook, and DDP prepares its
    gradient reduction in the root's post-forward hook. A training_step that calls a submodule
    directly (``self.model(x)``, the usual Lightning pattern) never runs ``self.forward``, so
    without this the root's parameters stay sharded ("mixed torch.Tensor and DTensor") and DDP
    never reduces. The redirection is Lightning's own (its DDP and FSDP strategies route steps
    through their wrapper's forward the same way); ``self(x)`` inside the hook is an ordinary
    nested call. (Sharding each submodule as a root of its own instead breaks on parameters of
    the LightningModule itself and on submodules called in any order or from several places.)
    """
    if not strategy.sharded.module_is_root:
        return getattr(ModelParallelStrategy, hook)(strategy, *args, **kwargs)
    with getattr(strategy.precision_plugin, _CONTEXTS[hook])():
        return strategy._forward_redirection(strategy.model, strategy.lightning_module, hook, *args, **kwargs)
