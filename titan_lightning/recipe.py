"""What a recipe returns, how one is loaded, and how a run becomes a Trainer.

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
import datetime
import importlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from titan_lightning.callbacks import TrainingMetrics
from titan_lightning.callbacks.metrics import SourceTokens
from titan_lightning.callbacks.preemption import PreemptionCheckpoint
from titan_lightning.callbacks.profiling import ProfileSteps
from titan_lightning.callbacks.weights import ExportWeights, LoadWeights, check_export, check_initial_weights, model_shapes
from titan_lightning.config import ConfigError, JobConfig, LRScheduleConfig, OptimizerConfig, TrainingConfig, validate_job
from titan_lightning.config.job import CP_ATTENTIONS
from titan_lightning.config.parallelism import CP_LOAD_BALANCERS
from titan_lightning.config.validation import gradient_accumulation_steps
from titan_lightning.data.datamodule import TextDataModule
from titan_lightning.strategies import TitanStrategy

RUN_DIR_ENV = "TITAN_LIGHTNING_RUN_DIR"


# Trainer arguments a JobConfig owns: (the field to set instead, Trainer's default).
_SET_BY_JOB = {
    "gradient_clip_val": ("job.training.max_grad_norm", None),
    "deterministic": ("job.training.deterministic", None),
    "accumulate_grad_batches": ("job.training.tokens_per_step", 1),
}


class RecipeError(ValueError):
    """A recipe that cannot be loaded or does not return a Run; the message is one line."""


@dataclass(kw_only=True)
class Run:
    """One training run: the module, its data, and the keyword arguments of ``lightning.Trainer``.

    Modules that read a ``JobConfig`` keep it as ``.job``; the module and the data
    module of a run share the same object, so changing a field changes the run.
    """

    module: L.LightningModule
    datamodule: Optional[L.LightningDataModule] = None
    trainer: dict[str, Any] = field(default_factory=dict)
    # Folder name under trainer.default_root_dir; the CLI sets it from the recipe name.
    name: str = "run"
    # Set by check_inputs before launch: the checkpoint fit resumes from (None: a fresh start).
    ckpt_path: Optional[str] = None
    inputs_checked: bool = False

    @property
    def job(self) -> Optional[JobConfig]:
        return getattr(self.module, "job", None)

    def set_job(self, job: JobConfig) -> None:
        """Give the module and the data module a new job config (after overrides)."""
        for part in (self.module, self.datamodule):
            if part is not None and hasattr(part, "job"):
                part.job = job


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


def run_dir(run: Run, root: Optional[str]) -> Path:
    """The folder this run writes into: ``<root>/<name>/<timestamp>``, shared by all ranks."""
    if RUN_DIR_ENV not in os.environ:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        os.environ[RUN_DIR_ENV] = str(Path(root or "runs") / run.name / stamp)
    return Path(os.environ[RUN_DIR_ENV])


def _validate_vocab(run: Run, job: JobConfig) -> None:
    tokenizer = getattr(run.datamodule, "tokenizer", None)
    if tokenizer is not None and tokenizer.vocab_size > job.model.vocab_size:
        raise ConfigError(
            f"the data's tokenizer has {tokenizer.vocab_size} tokens, more than model.vocab_size="
            f"{job.model.vocab_size}; use a model vocab_size >= {tokenizer.vocab_size}"
        )


# Lightning's precision flag -> (training.dtype, training.mixed_precision_param). The strategy
# applies it (FSDP's mixed-precision policy, or autocast on one device); Lightning's own
# precision plugin stays at 32-true so that nothing autocasts twice.
_PRECISION = {
    "32-true": ("float32", "float32"), "32": ("float32", "float32"), 32: ("float32", "float32"),
    "bf16-mixed": ("float32", "bfloat16"), "bf16-true": ("bfloat16", "bfloat16"),
}


def _apply_precision(kwargs: dict[str, Any], job: JobConfig) -> None:
    """Map ``trainer.precision`` onto the job's training dtypes (fp32 reduce stays as the job says)."""
    precision = kwargs.pop("precision", None)
    if precision is None:
        return
    if precision not in _PRECISION:
        raise ConfigError(
            f"trainer.precision={precision!r} is not supported; use one of 32-true, bf16-mixed, bf16-true "
            f"(or set training.dtype / training.mixed_precision_param)"
        )
    t = job.training
    dtype, param = _PRECISION[precision]
    if (t.dtype, t.mixed_precision_param) not in ((dtype, param), ("float32", "float32")):
        raise ConfigError(
            f"trainer.precision={precision!r} disagrees with training.dtype={t.dtype!r}, "
            f"training.mixed_precision_param={t.mixed_precision_param!r}; set the precision in one place"
        )
    t.dtype, t.mixed_precision_param = dtype, param


def checkpoint_callback(job: Optional[JobConfig], folder: Path) -> ModelCheckpoint:
    """Lightning's ModelCheckpoint as ``job.checkpoint`` asks: every ``interval`` steps, the newest
    ``keep_latest_k`` kept (ranked by step), into ``<run folder>/checkpoints``."""
    if job is None:
        return ModelCheckpoint(dirpath=folder / "checkpoints")
    c = job.checkpoint
    keep = {"save_top_k": c.keep_latest_k, "monitor": "step", "mode": "max"} if c.keep_latest_k != -1 else {"save_top_k": -1}
    if c.interval is None and c.keep_latest_k == -1:
        keep = {}  # Lightning's default: the newest checkpoint after each validation
    return ModelCheckpoint(dirpath=folder / "checkpoints", every_n_train_steps=c.interval, **keep)


def resume_path(run: Run, trainer: L.Trainer) -> Optional[str]:
    """The checkpoint ``job.checkpoint.resume_from`` names, checked (one-line CheckpointError
    otherwise); None to start fresh, saying so when "latest" finds nothing yet."""
    job = run.job
    if job is None:
        return run.ckpt_path  # a user's module: the recipe's own Run(ckpt_path=...)
    if job.checkpoint.resume_from is None:
        return None
    from titan_lightning.checkpoint import check_model_shapes, resolve_resume, unfinished_checkpoints

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
        print(f"titan-lightning: checkpoint.resume_from='latest': no complete checkpoint under {root} yet; "
              f"starting from step 0{note}", file=sys.stderr, flush=True)
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
    check = getattr(run.datamodule, "check_inputs", None)
    if callable(check):  # last: it reads and tokenizes the corpus (kept for setup)
        check()
    run.inputs_checked = True


def execute(command: str, run: Run, trainer: L.Trainer) -> None:
    """``trainer.<command>(module, datamodule)``; ``fit`` resumes from ``job.checkpoint.resume_from``."""
    if not run.inputs_checked:
        check_inputs(command, run, trainer)
    kwargs: dict[str, Any] = {"ckpt_path": run.ckpt_path} if command == "fit" else {}
    getattr(trainer, command)(run.module, datamodule=run.datamodule, **kwargs)


def train_description(trainer: L.Trainer) -> str:
    """"Epoch 2" for a run limited by epochs; a run limited by steps (max_epochs=-1, which
    Lightning's RichProgressBar would print as "Epoch 0/-2") also counts its steps: "Epoch 0, step 3/10"."""
    description = f"Epoch {trainer.current_epoch}"
    if trainer.max_epochs is not None and trainer.max_epochs >= 0:
        return f"{description}/{trainer.max_epochs - 1}"
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return f"{description}, step {trainer.global_step}/{trainer.max_steps}"
    return description


def _batches_done(trainer: L.Trainer) -> int:
    """Batches of this epoch already trained when it starts: 0, or where a resumed run continues."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed


def train_total(trainer: L.Trainer) -> Union[int, float]:
    """The training bar's total, in batches of this epoch: for a run limited by steps, the batches
    done (a resumed run's bar continues from them) plus the rest of ``max_steps`` times the batches
    per optimizer step. Lightning's own counts the remaining optimizer steps only, so a resumed
    run's bar (and one accumulating gradients) ran past its total and tqdm dropped it ("33/?")."""
    batches = trainer.num_training_batches
    if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
        remaining = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
        return min(batches, _batches_done(trainer) + remaining)
    return batches


class StepProgressBar(TQDMProgressBar):
    """Lightning's progress bar, its training bar described by ``train_description``."""

    @property
    def total_train_batches(self) -> Union[int, float]:
        return train_total(self.trainer)

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self._start(trainer)  # a run resumed inside an epoch gets no on_train_epoch_start

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._start(trainer)

    def _start(self, trainer: L.Trainer) -> None:
        bar = self.train_progress_bar
        bar.total = convert_inf(self.total_train_batches)
        bar.initial = bar.n = _batches_done(trainer)  # (its rate counts this run's batches only)
        bar.set_description(train_description(trainer))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_description(train_description(trainer), refresh=False)
        super().on_train_batch_end(trainer, *args)


class StepRichProgressBar(RichProgressBar):
    """Lightning's RichProgressBar, its training bar described by ``train_description``."""

    @property
    def total_train_batches(self) -> Union[int, float]:
        return train_total(self.trainer)

    def _get_train_description(self, current_epoch: int) -> str:  # Lightning's only hook for it
        return f"{train_description(self.trainer):{len(self.validation_description)}}"


def _progress_bar(callbacks: list) -> list:
    """Ours unless the run brings its own; Lightning's RichProgressBar becomes ours, settings kept."""
    for bar in callbacks:
        if type(bar) is RichProgressBar:
            bar.__class__ = StepRichProgressBar  # adds one method, no state
    if any(isinstance(c, ProgressBar) for c in callbacks):
        return callbacks
    return [*callbacks, StepProgressBar()]


def build_trainer(run: Run) -> L.Trainer:
    """Validate the run and build its Trainer. Nothing is written and nothing is spawned."""
    kwargs = dict(run.trainer)
    job = run.job
    if job is not None:
        for key, (instead, default) in _SET_BY_JOB.items():
            value = kwargs.pop(key, default)
            if value != default:
                raise ConfigError(f"trainer.{key}={value!r} is set by {instead}; set that instead")
        kwargs["deterministic"] = job.training.deterministic or None
        _apply_precision(kwargs, job)
        if kwargs.get("strategy", "auto") == "auto":
            kwargs["strategy"] = TitanStrategy()  # degrees from job.parallelism
        L.seed_everything(job.training.seed, verbose=False)
    folder = run_dir(run, kwargs.get("default_root_dir"))
    kwargs["default_root_dir"] = str(folder)
    if kwargs.get("logger") in (None, True):
        kwargs["logger"] = [
            TensorBoardLogger(save_dir=folder, name="tensorboard", version=""),
            CSVLogger(save_dir=folder, name="csv", version=""),
        ]
    callbacks = list(kwargs.get("callbacks") or [])
    if job is not None and not any(isinstance(c, TrainingMetrics) for c in callbacks):
        callbacks.append(TrainingMetrics())
    if job is not None and job.data.sources and not any(isinstance(c, SourceTokens) for c in callbacks):
        callbacks.append(SourceTokens())
    if job is not None and not any(isinstance(c, PreemptionCheckpoint) for c in callbacks):
        callbacks.append(PreemptionCheckpoint())
    if kwargs.get("enable_checkpointing", True) and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
        callbacks.append(checkpoint_callback(job, folder))
    if job is not None and job.checkpoint.initial_load_path is not None:
        callbacks.append(LoadWeights(job.checkpoint.initial_load_path, job.checkpoint.initial_load_format))
    if job is not None and (job.profiling.trace_steps or job.profiling.memory_snapshot_steps):
        callbacks.append(ProfileSteps(folder / "profile", job.profiling.trace_steps, job.profiling.memory_snapshot_steps))
    if job is not None and job.checkpoint.export_format is not None:
        where = folder / ("export_hf" if job.checkpoint.export_format == "hf" else "export")
        callbacks.append(ExportWeights(where, job.checkpoint.export_format, job.checkpoint.export_dtype))
    if kwargs.get("enable_progress_bar") is not False:
        callbacks = _progress_bar(callbacks)
    kwargs["callbacks"] = callbacks
    trainer = L.Trainer(**kwargs)
    if isinstance(trainer.strategy, TitanStrategy):  # (the job with the module, once)
        trainer.strategy.check_module(run.module, max_steps=trainer.max_steps)
    elif job is not None:
        validate_job(job, world_size=trainer.world_size, max_steps=trainer.max_steps,
                     device_type=trainer.strategy.root_device.type)
    if job is not None:
        _validate_vocab(run, job)
        trainer.accumulate_grad_batches = gradient_accumulation_steps(job, trainer.world_size)
    return trainer


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
    """``run`` on a parallel layout with the same global batch, so the same per-step losses.

    The data-parallel degree must be explicit (``dp_shard=-1`` would depend on the launch).
    """
    for name, value in degrees.items():
        setattr(run.job.parallelism, name, value)
    p = run.job.parallelism
    run.job.training.tokens_per_microbatch_per_dp_rank //= p.dp_replicate * max(p.dp_shard, 1)
    return run


def with_cp(run: Run, attention: str = "allgather", *, cp: int, **degrees) -> Run:
    """``run`` with a context-parallel attention over ``cp`` ranks, then ``on_layout(**degrees)``."""
    return on_layout(apply_transforms(run, [ContextParallelTransform(attention=attention, cp=cp)]), **degrees)


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
            raise ConfigError(f"ContextParallelTransform needs a run whose model has `attention`; got {type(run.module).__name__}")
        job.model.attention = self.attention
        if self.cp is not None:
            job.parallelism.cp = self.cp
        if self.load_balancer is not _UNSET:
            job.parallelism.cp_load_balancer = self.load_balancer


def apply_transforms(run: Run, transforms: Sequence[Transform], *, world_size: Optional[int] = None) -> Run:
    """A validated copy of ``run`` with ``transforms`` applied in order.

    ``world_size`` defaults to the product of the degrees (``dp_shard=-1`` counted as 1).
    """
    result = copy.deepcopy(run)
    for transform in transforms:
        transform(result)
    job = result.job
    if job is not None:
        p = job.parallelism
        validate_job(job, world_size=world_size or p.fixed_degrees * max(p.dp_shard, 1),
                     max_steps=result.trainer.get("max_steps"))
    return result
