"""What a recipe returns (``Run``, whose home is run.py), how one is loaded and run, and what
recipes share (how a run becomes a Trainer: trainer.py).

A recipe is a plain function with no arguments returning a ``Run``::

    def debugmodel() -> Run:
        job = Llama3Job(model=llama3_args("debugmodel"), ...)
        return Run(module=Llama3Module(job), datamodule=TextDataModule(job), trainer=dict(max_steps=100))

It is selected as ``package.module:function`` (``recipes.llama3:debugmodel``); a module in the
current folder is found too, as ``python -m`` would find it.

Transforms swap parts of a run's configuration tree; ``apply_transforms`` deep-copies the run,
applies each in order, validates the result (``validate_job``) and returns the copy, leaving the
original untouched if anything fails::

    run = apply_transforms(recipes.llama3.debugmodel(), [ContextParallelTransform(attention="ring", cp=2)])
"""

import copy
import importlib
import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import lightning as L

from titan_lightning.callbacks.progress import StepProgressBar  # noqa: F401 (re-exported: its home before)
from titan_lightning.callbacks.weights import LoadWeights, check_export, check_initial_weights, model_shapes
from titan_lightning.checkpoint import check_model_shapes, resolve_resume, unfinished_checkpoints
from titan_lightning.config import ConfigError, LRScheduleConfig, OptimizerConfig, TrainingConfig, validate_job
from titan_lightning.config.job import CP_ATTENTIONS
from titan_lightning.config.parallelism import CP_LOAD_BALANCERS
from titan_lightning.data.datamodule import TextDataModule
from titan_lightning.run import RecipeError, Run  # (their home: run.py; users' recipes import them here)
from titan_lightning.trainer import (  # noqa: F401 (re-exported: their home before trainer.py)
    RUN_DIR_ENV,
    build_trainer,
    checkpoint_callback,
    run_dir,
)

log = logging.getLogger(__name__)


def load_recipe(spec: str) -> Callable[[], Run]:
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise RecipeError(f"--recipe={spec!r} must look like package.module:function (e.g. recipes.llama3:debugmodel)")
    _find_modules_in_cwd()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise RecipeError(f"--recipe={spec!r}: no module named {err.name!r}") from None
        raise RecipeError(f"--recipe={spec!r}: importing {module_name!r} failed: {_exception_line(err)}") from err
    except Exception as err:  # noqa: BLE001 - the user's module: any error of its own import
        raise RecipeError(f"--recipe={spec!r}: importing {module_name!r} failed: {_exception_line(err)}") from err
    function = getattr(module, function_name, None)
    if not callable(function):
        available = sorted(
            name for name, value in vars(module).items()
            if callable(value) and not name.startswith("_") and getattr(value, "__module__", None) == module_name
            and not isinstance(value, type)
        )
        raise RecipeError(
            f"--recipe={spec!r}: module {module_name!r} has no recipe function {function_name!r}; "
            f"it defines: {', '.join(available) or 'nothing'}"
        )
    return function


def _find_modules_in_cwd() -> None:
    """Put the current folder first on sys.path, as ``python -m`` does (the console script's
    sys.path starts with its own folder instead). Ranks a launcher starts inherit the folder."""
    cwd = os.getcwd()
    if "" not in sys.path and not any(os.path.abspath(p) == cwd for p in sys.path if p):
        sys.path.insert(0, cwd)


# Recipe parameters the command line fills before it parses the rest (the run's options depend
# on them): parameter name -> the option that carries it.
RECIPE_PARAMETERS = {"initial_load_path": "job.checkpoint.initial_load_path", "dataset_path": "job.data.dataset_path"}


def _recipe_arguments(spec: str, function: Callable, values: dict[str, Optional[str]]) -> dict[str, str]:
    import inspect

    arguments = {}
    for name, parameter in inspect.signature(function).parameters.items():
        if name not in RECIPE_PARAMETERS:
            if parameter.default is inspect.Parameter.empty:
                raise RecipeError(f"--recipe={spec!r} takes an argument {name!r}; a recipe takes none, or only "
                                  f"{', '.join(RECIPE_PARAMETERS)}")
            continue
        if values.get(name) is not None:
            arguments[name] = values[name]
        elif parameter.default is inspect.Parameter.empty:
            example = {"initial_load_path": "a Hugging Face model folder",
                       "dataset_path": "a shard set of titan-lightning prepare"}[name]
            raise RecipeError(f"--recipe={spec!r} needs --{RECIPE_PARAMETERS[name]} ({example})")
    return arguments


def build_run(spec: str, values: Optional[dict[str, Optional[str]]] = None) -> Run:
    """The run of the recipe ``spec``; ``values`` fill its RECIPE_PARAMETERS."""
    function = load_recipe(spec)
    arguments = _recipe_arguments(spec, function, values or {})
    try:
        run = function(**arguments)
    except (RecipeError, ConfigError):
        raise
    except Exception as err:  # noqa: BLE001 - the user's recipe: any error it raises
        raise RecipeError(f"--recipe={spec!r} raised {_exception_line(err)}") from err
    if not isinstance(run, Run):
        raise RecipeError(
            f"--recipe={spec!r} returned {type(run).__name__}, expected titan_lightning.recipe.Run"
        )
    module_name, _, function_name = spec.partition(":")
    run.name = f"{module_name.rsplit('.', 1)[-1]}_{function_name}"
    return run


def _exception_line(err: BaseException) -> str:
    """``Type: message`` on one line, with the file and line for a syntax error."""
    if isinstance(err, SyntaxError) and err.filename:
        return f"SyntaxError: {err.msg} ({err.filename}, line {err.lineno})"
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def resume_path(run: Run, trainer: L.Trainer) -> Optional[str]:
    """The checkpoint ``job.checkpoint.resume_from`` names, checked (one-line CheckpointError
    otherwise); None to start fresh, saying so when "latest" finds nothing yet."""
    job = run.job
    if job is None:
        return run.ckpt_path  # a user's module: the recipe's own Run(ckpt_path=...)
    if job.checkpoint.resume_from is None:
        return None

    # "latest" searches every run of this recipe: <root>/<name>/<timestamp>/checkpoints.
    root = Path(trainer.default_root_dir).parent
    path = resolve_resume(job.checkpoint.resume_from, root, checksums=job.checkpoint.verify_checksums)
    if path is not None:
        what = f"checkpoint.resume_from={job.checkpoint.resume_from!r}" + (
            f" ({path})" if job.checkpoint.resume_from == "latest" else "")
        shapes = model_shapes(run.module)
        if shapes is not None:
            check_model_shapes(Path(path), shapes, what)
    if path is None and trainer.global_rank == 0:
        ignored = unfinished_checkpoints(root)
        note = (f" ({len(ignored)} folder(s) without a completion manifest ignored, e.g. {ignored[-1]}: "
                f"unfinished saves)" if ignored else "")
        log.warning(f"titan-lightning: checkpoint.resume_from='latest': no complete checkpoint under {root} yet; "
                    f"starting from step 0{note}")
    return path


def check_inputs(command: str, run: Run, trainer: L.Trainer) -> None:
    """Every file the run names, before launch: data, tokenizer, initial weights, the checkpoint
    to resume (resolved once, kept in ``run.ckpt_path``). One-line errors naming the field."""
    job = run.job
    if job is None:
        return
    if job.checkpoint.initial_load_path is not None and command == "fit":
        check_initial_weights(job.checkpoint.initial_load_path, job.checkpoint.initial_load_format, run.module,
                              checksums=job.checkpoint.verify_checksums)
    if command == "fit":
        check_export(run.module, job.checkpoint.export_format)
    run.ckpt_path = resume_path(run, trainer) if command == "fit" else None
    fresh = getattr(run.module, "check_fresh_start", None)
    if command == "fit" and run.ckpt_path is None and callable(fresh):  # (e.g. the adapters lora.init_from holds)
        fresh()
    check = getattr(run.datamodule, "check_inputs", None)
    if callable(check):  # last: it reads and tokenizes the corpus (kept for setup); a run by epochs fills a step
        check(trainer if command == "fit" else None)
    run.inputs_checked = True


def execute(command: str, run: Run, trainer: L.Trainer) -> None:
    """``trainer.<command>(module, datamodule)``; ``fit`` resumes from ``job.checkpoint.resume_from``."""
    if not run.inputs_checked:
        check_inputs(command, run, trainer)
    kwargs: dict[str, Any] = {"ckpt_path": run.ckpt_path} if command == "fit" else {}
    for callback in trainer.callbacks:  # (a resumed fit never reads the adapters it started from)
        if isinstance(callback, LoadWeights):
            callback.resuming = run.ckpt_path is not None  # (None unless the command is fit)
    getattr(trainer, command)(run.module, datamodule=run.datamodule, **kwargs)


# -- what recipes share ----------------------------------------------------------------------


def family_run(job_class: type, module_class: type, args, **job_sections) -> Run:
    """A run of a model family (``Llama3Job, Llama3Module, llama3_args("8B")``) on the shipped
    corpus, 1000 steps; ``job_sections`` (``training=TrainingConfig(...)``, ...) replace the defaults."""
    job = job_class(model=args, **job_sections)
    return Run(module=module_class(job), datamodule=TextDataModule(job), trainer=dict(max_steps=1000))


def debug_run(job_class: type, module_class: type, args) -> Run:
    """A debug model's CPU run: 100 steps of 8 x 256 tokens at lr 2e-3, validated at steps 50 and 100."""
    run = family_run(
        job_class, module_class, args,
        training=TrainingConfig(seq_len=256, tokens_per_microbatch_per_dp_rank=2048, max_grad_norm=1.0),
        optimizer=OptimizerConfig(lr=2e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=10, decay_ratio=0.5),
    )
    run.trainer.update(max_steps=100, log_every_n_steps=1, val_check_interval=50, limit_val_batches=4)
    return run


def size_run(job_class: type, module_class: type, args, *, seq_len: int, lr: float) -> Run:
    """A published size: one ``seq_len`` sequence per microbatch, fp32 weights with bf16 compute,
    200 warmup steps then decay over the last 20%."""
    return family_run(
        job_class, module_class, args,
        training=TrainingConfig(seq_len=seq_len, tokens_per_microbatch_per_dp_rank=seq_len, dtype="float32",
                                mixed_precision_param="bfloat16"),
        optimizer=OptimizerConfig(lr=lr),
        lr_schedule=LRScheduleConfig(warmup_steps=200, decay_ratio=0.2),
    )


def on_layout(run: Run, **degrees) -> Run:
    """``run`` on a parallel layout with the same global batch, so the same per-step losses; the
    run gets a derived job (the one it had is left as it was).

    The data-parallel degree must be explicit (``dp_shard=-1`` would depend on the launch).
    """
    job = run.job
    p = replace(job.parallelism, **degrees)
    tokens = job.training.tokens_per_microbatch_per_dp_rank // (p.dp_replicate * max(p.dp_shard, 1))
    run.set_job(replace(job, parallelism=p, training=replace(job.training, tokens_per_microbatch_per_dp_rank=tokens)))
    return run


def with_cp(run: Run, attention: str = "allgather", *, cp: int, **degrees) -> Run:
    """``run`` with a context-parallel attention over ``cp`` ranks, then ``on_layout(**degrees)``;
    validated at launch, with the launch's world size (``apply_transforms`` validates at once)."""
    return on_layout(transformed(run, [ContextParallelTransform(attention=attention, cp=cp)]), **degrees)


# -- transforms: swap parts of a run's configuration tree, then validate the whole run --------

Transform = Callable[[Run], None]
_UNSET = object()


@dataclass(frozen=True)
class ContextParallelTransform:
    """Give the model a context-parallel attention; optionally set ``parallelism.cp`` and the load balancer."""

    attention: str = "allgather"
    cp: Optional[int] = None
    load_balancer: object = _UNSET  # "headtail", None, ...; unset keeps the run's

    def __post_init__(self) -> None:
        if self.attention not in CP_ATTENTIONS:
            raise ValueError(
                f"ContextParallelTransform(attention={self.attention!r}): expected one of {', '.join(CP_ATTENTIONS)}"
            )
        if self.cp is not None and (not isinstance(self.cp, int) or self.cp < 2):
            raise ValueError(f"ContextParallelTransform(cp={self.cp!r}): expected an integer >= 2, or None")
        if self.load_balancer is not _UNSET and self.load_balancer not in (*CP_LOAD_BALANCERS, None):
            raise ValueError(
                f"ContextParallelTransform(load_balancer={self.load_balancer!r}): expected one of "
                f"{', '.join(CP_LOAD_BALANCERS)} or None"
            )

    def __call__(self, run: Run) -> None:
        job = run.job
        if job is None or not hasattr(job.model, "attention"):
            raise RecipeError(f"ContextParallelTransform needs a run whose model has `attention`; got {type(run.module).__name__}")
        degrees = {} if self.cp is None else {"cp": self.cp}
        if self.load_balancer is not _UNSET:
            degrees["cp_load_balancer"] = self.load_balancer
        run.set_job(replace(job, model=replace(job.model, attention=self.attention),
                            parallelism=replace(job.parallelism, **degrees)))


def transformed(run: Run, transforms: Sequence[Transform]) -> Run:
    """A copy of ``run`` with ``transforms`` applied in order, not validated: a recipe's run is
    validated at launch (``build_trainer``), once."""
    result = copy.deepcopy(run)
    for transform in transforms:
        transform(result)
    return result


def apply_transforms(run: Run, transforms: Sequence[Transform], *, world_size: Optional[int] = None) -> Run:
    """A validated copy of ``run`` with ``transforms`` applied in order.

    ``world_size`` defaults to the product of the degrees (``dp_shard=-1`` counted as 1).
    """
    result = transformed(run, transforms)
    job = result.job
    if job is not None:
        p = job.parallelism
        validate_job(job, world_size=world_size or p.fixed_degrees * max(p.dp_shard, 1),
                     max_steps=result.trainer.get("max_steps"))
    return result
