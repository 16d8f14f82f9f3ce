"""Every private name of Lightning and torch that titan_lightning uses still exists, with the
parameters we call it with (titan_lightning/_compat.py; CONTRIBUTING "Moving the Lightning pin").

In-process, nothing runs: each check is an import, an attribute or a signature."""

import configparser
import inspect
import os
import re
from pathlib import Path

import lightning
import pytest
import torch
from packaging.requirements import Requirement

from titan_lightning import _compat

ROOT = Path(__file__).resolve().parents[3]


def _parameters(fn) -> list[str]:
    """The parameter names of ``fn``: from its signature, or for a pybind function from the
    ``name(a: ..., b: ...) -> ...`` first line of its docstring."""
    try:
        return list(inspect.signature(fn).parameters)
    except ValueError:
        first = (fn.__doc__ or "").strip().splitlines()[0]
        inside = re.match(r"\w+\((.*)\)", first)
        assert inside, f"{fn!r}: no signature and no docstring signature ({first!r})"
        return [p.split(":")[0].strip() for p in inside.group(1).split(",") if p.strip()]


def _takes(fn, *names: str) -> None:
    params = _parameters(fn)
    missing = [n for n in names if n not in params]
    assert not missing, f"{getattr(fn, '__qualname__', fn)} lost {missing}; it takes {params}"


# -- what _compat binds, and the parameters titan_lightning calls each with -----------------------

LIGHTNING_CALLS = {
    "ChildProcessObserver": ("main_pid", "child_processes", "sleep_period"),  # strategies/launcher.py
    "SubprocessScriptLauncher": ("cluster_environment", "num_processes", "num_nodes"),
    "set_num_threads_if_needed": ("num_processes",),
    "distributed_is_initialized": (),
    "materialize_distributed_module": ("module", "device"),
    "optimizers_to_device": ("optimizers", "device"),
    "lightning_rank": (),  # testing/zygote.py
}


@pytest.mark.parametrize("name", sorted(LIGHTNING_CALLS))
def test_lightning_names(name):
    value = getattr(_compat, name)
    module, private = _compat.LIGHTNING_NAMES[name]
    assert value.__module__ == module and value.__name__ == private
    _takes(value.__init__ if inspect.isclass(value) else value, *LIGHTNING_CALLS[name])


def test_every_lightning_name_is_checked():
    assert set(_compat.LIGHTNING_NAMES) == set(LIGHTNING_CALLS)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _compat.nope  # noqa: B018


def test_lightning_internals_our_subclasses_use():
    """Private members of Lightning classes that strategies/ (titan, launcher, step_hooks, fake) and
    callbacks/progress.py
    override or read (they stay where they are; this says when one moves)."""
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.strategies import ModelParallelStrategy

    observer = _compat.ChildProcessObserver(main_pid=os.getpid(), child_processes=[], sleep_period=1)
    assert observer._child_processes == [] and isinstance(observer._termination_signal, int)
    _takes(observer._run)  # overridden: () -> bool
    _takes(observer._terminate_all)
    launcher = _compat.SubprocessScriptLauncher
    _takes(launcher._call_children_scripts)
    assert "self.procs" in inspect.getsource(launcher.__init__)  # the children _Launcher hands its observer
    _takes(launcher.kill, "signum")
    _takes(launcher.launch, "function", "trainer")

    strategy = ModelParallelStrategy()
    assert strategy._launcher is None and callable(strategy._forward_redirection)
    _takes(strategy._configure_launcher)
    _takes(type(strategy._forward_redirection).__call__, "wrapper_module", "original_module", "method_name")
    _takes(ModelParallelStrategy.setup_optimizers, "trainer")

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert LightningOptimizer(sgd)._optimizer is sgd  # strategies/checkpoint_io.py unwraps it
    _takes(_TrainingEpochLoop._should_accumulate)  # the rule titan_lightning/steps.py mirrors
    _takes(RichProgressBar._get_train_description, "current_epoch")  # overridden in callbacks/progress.py


def test_trainer_and_checkpoint_internals():
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    assert isinstance(type(trainer._logger_connector).should_update_logs, property)
    assert _compat.logs_this_step(trainer) in (True, False)
    assert _compat.logs_this_step(object()) is True  # no connector: every step logs

    callback = ModelCheckpoint()
    assert hasattr(callback, "_last_global_step_saved")
    _compat.mark_checkpoint_saved(callback, 7)
    assert callback._last_global_step_saved == 7


def test_torch_distributed_names():
    c10d = torch.distributed.distributed_c10d
    _takes(c10d._get_default_group)
    _takes(c10d._resolve_process_group, "group_name")
    assert isinstance(c10d._world.pg_names, dict)
    assert _compat.process_group_names() is c10d._world.pg_names
    _takes(_compat.funcol.wait_tensor, "tensor")
    _takes(_compat.funcol.all_to_all_single, "self", "output_split_sizes", "input_split_sizes", "group")
    _takes(_compat.StridedShard.__init__, "dim", "split_factor")
    _takes(_compat.compute_local_shape_and_global_offset, "global_shape", "mesh", "placements")
    from torch.distributed.device_mesh import DeviceMesh

    _takes(DeviceMesh._flatten, "mesh_dim_name")
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._traverse import set_element

    _takes(flatten_state_dict, "state_dict")
    _takes(set_element, "root_dict", "path", "value")
    flat, mappings = _compat.flatten_state_dict({"a": {"b": 1}})
    root = {"a": {"b": 0}}
    _compat.set_element(root, mappings["a.b"], 2)
    assert flat == {"a.b": 1} and root == {"a": {"b": 2}}

    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineScheduleRuntime

    assert issubclass(_PipelineScheduleRuntime, PipelineScheduleMulti)
    _takes(PipelineScheduleMulti.__init__, "stages", "n_microbatches", "loss_fn", "scale_grads")
    _takes(_PipelineScheduleRuntime._load_csv, "filename")

    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    assert isinstance(_compat.fake_store(), FakeStore)
    local, isolation, install, uninstall = _compat.threaded_process_group()
    assert (install, uninstall) == (_install_threaded_pg, _uninstall_threaded_pg)
    _takes(local.exception_handle, "exc")
    _takes(local.reset)
    _takes(isolation, "enable")
    recorders = _compat.flight_recorders()
    assert "fr" in recorders
    from torch._C import _distributed_c10d as c10d_c

    _takes(c10d_c._dump_fr_trace_json, "includeCollectives")
    if hasattr(c10d_c, "_dump_nccl_trace_json"):  # CUDA builds only
        _takes(c10d_c._dump_nccl_trace_json, "includeCollectives", "includeStackTraces")

    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    assert hasattr(propagator, "propagate_op_sharding")
    assert hasattr(_redistribute, "_gen_transform_infos")
    _compat.clear_dtensor_caches()


def test_fake_tensor_dynamo_inductor_names():
    from torch._subclasses import fake_tensor

    assert _compat.FakeTensorMode is fake_tensor.FakeTensorMode and _compat.FakeTensor is fake_tensor.FakeTensor
    _takes(_compat.FakeTensorMode.__init__, "allow_non_fake_inputs")
    assert all(issubclass(error, Exception) for error in _compat.FAKE_TENSOR_ERRORS)
    with _compat.unset_fake_temporarily():
        pass
    assert _compat.dynamo_disable is torch._dynamo.disable
    _takes(_compat.list_backends, "exclude_tags")
    _takes(_compat.register_backend, "compiler_fn", "name")
    assert "inductor" in _compat.list_backends(exclude_tags=())
    assert hasattr(_compat.dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint")  # parallel/compile.py
    aot_autograd, partition, decompositions = _compat.estimate_backend_parts()
    _takes(aot_autograd, "kwargs")
    _takes(partition, "joint_module")
    assert isinstance(decompositions, dict) and decompositions
    from torch._inductor import config as inductor_config

    assert hasattr(inductor_config, "emulate_precision_casts")  # parallel/float8.py
    _takes(_compat.TorchDispatchMode.__torch_dispatch__, "func", "types", "args", "kwargs")
    assert _compat.tree_leaves([1, (2, {"a": 3})]) == [1, 2, 3]


def test_cuda_memory_history_names():
    _takes(torch.cuda.memory._record_memory_history, "enabled", "max_entries")
    _takes(torch.cuda.memory._dump_snapshot, "filename")


def test_torch_internals_used_where_they_stand():
    """Private operators and attributes titan_lightning uses in place (listed in _compat's docstring)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    aten = torch.ops.aten
    for op in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",  # parallel/context_ring.py
               "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward",
               "_local_scalar_dense", "_unique2"):  # testing/host_sync.py
        assert hasattr(aten, op), op
    assert callable(torch._grouped_mm) and callable(torch._foreach_mul_)  # models/common/moe.py, parallel/grad_norm.py
    _takes(ColwiseParallel._prepare_output_fn, "output_layouts", "use_local_output", "mod", "outputs", "device_mesh")
    assert torch.zeros(1).untyped_storage()._cdata  # estimate.py keys storages by it
    # parallel/fsdp.py re-orders the root module's forward hooks by these dicts
    linear = torch.nn.Linear(1, 1)
    for hooks in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs"):
        assert isinstance(getattr(linear, hooks), dict), hooks
    from torch.distributed._composable.replicate import replicate

    _takes(replicate, "module")


def test_lightning_pin_matches_the_installed_version():
    """setup.cfg pins Lightning to the minor release this test (and the suite) ran on."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requirements = [Requirement(line) for line in config["options"]["install_requires"].split("\n") if line.strip()]
    pin = next(r for r in requirements if r.name == "lightning")
    assert pin.specifier.contains(lightning.__version__), f"lightning {lightning.__version__} is outside {pin}"
    assert any(s.operator == "<" for s in pin.specifier), f"{pin}: no upper bound"
