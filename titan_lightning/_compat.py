"""Every private name of Lightning and torch that titan_lightning imports or calls, in one place.

A minor release of either may rename or remove a private name without notice; here each one is
reached once, under a stable name, and ``tests/unit_tests/cpu/test_compat.py`` asserts that each
still exists with the parameters we call it with. When that test fails after an upgrade, fix
this module (CONTRIBUTING.md: "Moving the Lightning pin").

Checked on lightning 2.6.6 (setup.cfg pins ``lightning>=2.6,<2.7``) and on torch 2.11 (the GPU
machine) and 2.13 (CI).

Names of modules torch or Lightning import anyway are bound here at import; those of modules
they do not (inductor, functorch, DCP's helpers, pipelining schedules) are imported when first
called, to keep ``import titan_lightning`` fast.

Not routed through here (asserted by the test only, as they are used where they stand):
private attributes that titan_lightning's subclasses of Lightning classes inherit
(``Strategy._forward_redirection``, ``_configure_launcher`` / ``_launcher``,
``_ChildProcessObserver._child_processes`` / ``_termination_signal``, ``LightningOptimizer._optimizer``,
``_TrainingEpochLoop._should_accumulate``, ``RichProgressBar._get_train_description`` overridden in
callbacks/progress.py), ``nn.Module``'s hook dicts read in parallel/fsdp.py, and torch's private operators
(``torch._grouped_mm``, ``torch._foreach_mul_``, ``aten._scaled_dot_product_flash_attention*``).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import Any, Callable, Optional

import torch
import torch._C._distributed_c10d as _c10d_c
import torch._dynamo
import torch.distributed as dist
from torch._subclasses import fake_tensor as _fake_tensor
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "ChildProcessObserver", "SubprocessScriptLauncher", "set_num_threads_if_needed", "distributed_is_initialized",
    "materialize_distributed_module", "optimizers_to_device", "lightning_rank", "logs_this_step",
    "mark_checkpoint_saved", "hide_expected_lightning_output",
    "default_group", "resolve_process_group", "process_group_names", "funcol", "StridedShard",
    "compute_local_shape_and_global_offset", "TorchDispatchMode", "tree_leaves", "FakeTensor", "FakeTensorMode",
    "unset_fake_temporarily", "FAKE_TENSOR_ERRORS", "dynamo_disable", "dynamo_config", "list_backends",
    "register_backend", "estimate_backend_parts", "set_inductor_emulate_precision_casts", "flatten_state_dict",
    "set_element", "pipeline_schedule_from_csv", "fake_store", "threaded_process_group", "flight_recorders",
    "record_memory_history", "dump_memory_snapshot", "flatten_mesh", "clear_dtensor_caches",
]

# -- Lightning ---------------------------------------------------------------------------------

# Bound on first use (PEP 562), so that parallel/, which imports this module for torch's names,
# stays free of Lightning.
LIGHTNING_NAMES = {
    "ChildProcessObserver": ("lightning.fabric.strategies.launchers.subprocess_script", "_ChildProcessObserver"),
    "SubprocessScriptLauncher": ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    "set_num_threads_if_needed": ("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed"),
    "distributed_is_initialized": ("lightning.fabric.utilities.distributed", "_distributed_is_initialized"),
    "materialize_distributed_module": ("lightning.fabric.utilities.init", "_materialize_distributed_module"),
    "optimizers_to_device": ("lightning.fabric.utilities.optimizer", "_optimizers_to_device"),
    "lightning_rank": ("lightning.fabric.utilities.rank_zero", "_get_rank"),
}


def __getattr__(name: str) -> Any:
    if name not in LIGHTNING_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, private = LIGHTNING_NAMES[name]
    value = getattr(importlib.import_module(module), private)
    globals()[name] = value
    return value


def logs_this_step(trainer: Any) -> bool:
    """Whether the optimizer step about to run sends its metrics to the loggers (Lightning's
    ``trainer._logger_connector.should_update_logs``; True where a trainer lacks it)."""
    connector = getattr(trainer, "_logger_connector", None)
    should = getattr(connector, "should_update_logs", None)
    return True if should is None else bool(should)


def mark_checkpoint_saved(callback: Any, global_step: int) -> None:
    """Tell a ModelCheckpoint that ``global_step`` is saved (its ``_last_global_step_saved``, the
    attribute it reads to skip a step it already saved); nothing where it has no such attribute."""
    if hasattr(callback, "_last_global_step_saved"):
        callback._last_global_step_saved = global_step


# What Lightning prints that a titan-lightning run cannot act on, each with why it is expected.
# The command line hides them (cli.main); a program that builds its own Trainer keeps them.
# (Lightning's "IterableDataset has __len__" is hidden where our datasets are made:
# data/datamodule.py says why their lengths are exact.)
EXPECTED_LIGHTNING_WARNINGS = (
    # torch 2.10 deprecated isinstance(x, LeafSpec); Lightning 2.6's utilities/_pytree.py still asks
    # it of every batch it moves to the device; nothing of ours calls it.
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # Lightning doubts the length of any IterableDataset under several DataLoader workers; ours hand
    # whole batches to the workers in turn (data/dataset.py, _worker_positions): exact with any
    # data.num_workers (the val loaders, and the train loader of a run by epochs).
    (UserWarning, r"Your `IterableDataset` has `__len__` defined"),
)
# Lightning's advertisements on its INFO log ("💡 Tip: ... try installing litlogger / litmodels"),
# printed whatever the run's loggers and checkpoints are.
LIGHTNING_TIP = "💡 Tip:"
LIGHTNING_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(LIGHTNING_TIP)


def hide_expected_lightning_output() -> None:
    """Hide EXPECTED_LIGHTNING_WARNINGS and Lightning's tips, for the rest of the process."""
    for category, message in EXPECTED_LIGHTNING_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in LIGHTNING_RANK_ZERO_LOGGERS:  # (rank_zero_info logs to one of them, the last imported)
        logger = logging.getLogger(name)
        if _not_a_tip not in logger.filters:
            logger.addFilter(_not_a_tip)


# -- torch.distributed -------------------------------------------------------------------------

def default_group() -> Any:
    """The default process group (``distributed_c10d._get_default_group``)."""
    return dist.distributed_c10d._get_default_group()


def resolve_process_group(name: str) -> Any:
    """The process group registered under ``name`` (``distributed_c10d._resolve_process_group``)."""
    return dist.distributed_c10d._resolve_process_group(name)


def process_group_names() -> dict:
    """{group: name} of every process group (``distributed_c10d._world.pg_names``)."""
    return dist.distributed_c10d._world.pg_names


StridedShard = _StridedShard


def flatten_state_dict(state: dict) -> tuple[dict, dict]:
    """DCP's ``_nested_dict.flatten_state_dict``: (flat state, mappings)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten  # (start-up time)

    return flatten(state)


def set_element(root: dict, path: Any, value: Any) -> None:
    """DCP's ``_traverse.set_element``: put ``value`` at ``path`` in the nested ``root``."""
    from torch.distributed.checkpoint._traverse import set_element as put  # (start-up time)

    put(root, path, value)


def pipeline_schedule_from_csv(stages: list, microbatches: int, loss_fn: Callable, csv: str) -> Any:
    """A pipeline schedule read from a CSV action list (``_PipelineScheduleRuntime._load_csv``)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime  # (start-up time)

    schedule = _PipelineScheduleRuntime(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule._load_csv(csv)
    return schedule


def fake_store() -> Any:
    """A store for torch's "fake" process group (``torch.testing._internal...fake_pg.FakeStore``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def threaded_process_group() -> tuple[Any, Callable[[bool], None], Callable[[], None], Callable[[], None]]:
    """torch's threaded process group (a test helper of ``torch.testing._internal``):
    (ProcessLocalGroup, set_thread_isolation_mode(on), install(), uninstall())."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    return ProcessLocalGroup, _c10d_c._set_thread_isolation_mode, _install_threaded_pg, _uninstall_threaded_pg


def flight_recorders() -> dict[str, Callable[[bool], bytes]]:
    """torch's flight recorders: the generic one (gloo, ...) and, in CUDA builds, NCCL's;
    each takes ``collectives`` (whether to include them) and returns the trace as JSON bytes."""
    found = {"fr": lambda collectives: _c10d_c._dump_fr_trace_json(includeCollectives=collectives)}
    if hasattr(_c10d_c, "_dump_nccl_trace_json"):
        found["nccl"] = lambda collectives: _c10d_c._dump_nccl_trace_json(includeCollectives=collectives,
                                                                          includeStackTraces=False)
    return found


def flatten_mesh(mesh: Any, name: str) -> Any:
    """The 1-D mesh over the dims of ``mesh``, named ``name`` (``DeviceMesh._flatten``)."""
    return mesh._flatten(mesh_dim_name=name)


def clear_dtensor_caches() -> None:
    """Clear DTensor's sharding-propagation and redistribution caches, each only where it exists
    (``DTensor._op_dispatcher.sharding_propagator``'s, the C++ fast path's, ``_gen_transform_infos``)."""
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (getattr(propagator, "propagate_op_sharding", None), getattr(propagator, "_propagate_tensor_meta_cached", None)):
        for clear in (getattr(cached, "cache_clear", None), getattr(getattr(cached, "cache", None), "cache_clear", None)):
            if clear is not None:
                clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's
    if native is not None:
        native()
    gen = getattr(_redistribute, "_gen_transform_infos", None)
    if gen is not None and hasattr(gen, "cache_clear"):
        gen.cache_clear()


# -- fake tensors, dynamo, inductor ------------------------------------------------------------

FakeTensor = _fake_tensor.FakeTensor
FakeTensorMode = _fake_tensor.FakeTensorMode
unset_fake_temporarily = _fake_tensor.unset_fake_temporarily
FAKE_TENSOR_ERRORS = (_fake_tensor.DynamicOutputShapeException, _fake_tensor.DataDependentOutputException,
                      _fake_tensor.UnsupportedOperatorException, _fake_tensor.UnsupportedFakeTensorException)

dynamo_disable = torch._dynamo.disable
dynamo_config = torch._dynamo.config
list_backends = torch._dynamo.list_backends
register_backend = torch._dynamo.register_backend


def estimate_backend_parts() -> tuple[Callable, Callable, dict]:
    """(aot_autograd, min_cut_rematerialization_partition, inductor's decomposition table)."""
    from torch._dynamo.backends.common import aot_autograd  # (start-up time: inductor)
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import select_decomp_table

    return aot_autograd, min_cut_rematerialization_partition, select_decomp_table()


def set_inductor_emulate_precision_casts() -> None:
    """Inductor rounds casts as eager does (``torch._inductor.config.emulate_precision_casts``)."""
    import torch._inductor.config  # (start-up time)

    torch._inductor.config.emulate_precision_casts = True


# -- CUDA memory history -----------------------------------------------------------------------

def record_memory_history(enabled: Optional[str] = "all", max_entries: int = 200_000) -> None:
    """Start (``enabled="all"``, torch's default) or stop (``enabled=None``) the CUDA allocator's history."""
    if enabled is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write the CUDA allocator's history to ``path`` (a pickle for pytorch.org/memory_viz)."""
    torch.cuda.memory._dump_snapshot(path)
