"""``titan-lightning fit|validate|test|estimate --recipe package.module:function [overrides]``.

Options (frozen by tests/unit_tests/cpu/test_cli.py; new knobs go into the configs):

    --recipe MOD:FN      the run to start from
    --config FILE        a YAML file written by --print_config (it names its recipe); a pipe
                         works too: --config <(sed s/0.002/0.001/ run.yaml)
    --print_config       print the fully resolved run as YAML and exit
    --job.SECTION.FIELD  override a JobConfig field (model, training, parallelism, ...)
    --trainer.ARG        override a lightning.Trainer argument; --trainer.logger and
                         --trainer.callbacks take class paths as in LightningCLI (a logger
                         replaces the recipe's, callbacks are added to the recipe's):
                           --trainer.logger lightning.pytorch.loggers.CSVLogger --trainer.logger.save_dir logs
                           --trainer.callbacks+ lightning.pytorch.callbacks.LearningRateMonitor
                           --trainer.logger false

``titan-lightning fit --help`` lists every option (with --recipe, that recipe's values as defaults).

``estimate`` takes the same options and overrides, plus its own (see titan_lightning/estimate.py):

    --world_size N       the world to estimate for (required)
    --rank R             the rank to simulate (default 0)
    --json               print bytes as JSON instead of the table in GiB

``prepare`` turns JSONL, Parquet and text files into token shards for ``data.dataset_path``
(``titan-lightning prepare --help``; titan_lightning/data/prepare.py).

``generate`` and ``chat`` try a model (a Hugging Face folder, a run folder or a checkpoint) with
our decoder and a KV cache (``titan-lightning generate --help``; titan_lightning/generate.py).

Bad input exits with status 2 and one line on stderr, before anything is written.
A recipe module in the current folder is found (``--recipe my_recipes:fn``), as with ``python -m``.
"""

import argparse
import dataclasses
import inspect
import json
import logging
import os
import re
import select
import stat
import sys
import traceback
import typing
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Iterator, Optional, Sequence, Union

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser

import lightning as L

from titan_lightning._compat import hide_expected_lightning_output
from titan_lightning.checkpoint import CheckpointError
from titan_lightning.config import ConfigError, JobConfig
from titan_lightning.data.prepare import main as prepare_main
from titan_lightning.device_defaults import explicit_line, named_fields
from titan_lightning.flags import OPTIONS, RECIPE_REQUIRED, SUBCOMMANDS, recipe_arg, section_type, unknown_command
from titan_lightning.generate import COMMANDS as GENERATE_COMMANDS
from titan_lightning.generate import main as generate_main
from titan_lightning.parallel.mesh import release_dtensor_caches
from titan_lightning.recipe import RECIPE_PARAMETERS, Run, RecipeError, build_run, check_inputs, execute
from titan_lightning.trainer import build_trainer

# Trainer arguments that hold objects: a recipe sets them, the command line does not.
# (`strategy` is on the command line as a registry name or a class path, see build_parser.)
_OBJECT_ARGS = ("plugins",)
# Objects both may set, the command line as LightningCLI does (class_path + init_args). The
# recipe's are never parser defaults (objects do not print): the command line's logger replaces
# the recipe's, its callbacks are added to the recipe's.
_ADDED_ARGS = ("logger", "callbacks")


# Set to 1 to see the traceback behind a one-line error.
DEBUG_ENV = "TITAN_LIGHTNING_DEBUG"


class UsageError(ValueError):
    """Bad command-line input; reported as one line with exit status 2."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Bad input (found before launch): one line on stderr, exit 2, nothing written. A known
    failure of the run itself (a checkpoint that cannot be written, ...): one line, exit 1.
    A reader that stops early (``titan-lightning fit --help | head``): exit 1, nothing printed."""
    hide_expected_lightning_output()
    try:
        try:
            return _main(list(sys.argv[1:] if argv is None else argv))
        finally:
            sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
    except BrokenPipeError:
        # Python's advice (library/signal.html, "Note on SIGPIPE"): send what is left to devnull.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: list[str]) -> int:
    try:
        with held_lightning_output():
            if argv and argv[0] == "estimate":
                return estimate_command(argv[1:])
            if argv and argv[0] == "prepare":
                return prepare_main(argv[1:])
            if argv and argv[0] in GENERATE_COMMANDS:
                return generate_main(argv[0], argv[1:], parse_run)
            prepared = prepare(argv)
    except BrokenPipeError:
        raise
    except Exception as err:  # noqa: BLE001 - every failure before launch is reported in one line
        _report(err)
        return 2
    if prepared is None:
        return 0
    command, run, trainer = prepared
    rank = trainer.global_rank if trainer.world_size > 1 else None
    bar = trainer.progress_bar_callback is not None  # (its line may be unfinished: errors start a new one)
    try:
        execute(command, run, trainer)
    except RUN_FAILURES as err:
        _report(err, rank=rank, fresh_line=bar)
        _end_process_group(failed=True)
        return 1
    except Exception as err:
        heartbeat = getattr(trainer.strategy, "heartbeat", None)
        lost = heartbeat.explain() if heartbeat is not None else None
        if lost is None:
            _end_process_group(failed=True)
            raise
        _report(RankLost(lost), rank=rank, fresh_line=bar)
        os._exit(1)  # a peer is gone: leave without the backend's shutdown, which would wait for it
    _end_process_group()
    return 0


def _end_process_group(failed: bool = False) -> None:
    """The run's strategy leaves the process group up for what follows the command in the same
    process (as Lightning's strategies do); the command line ends it, every rank together (after a
    failure without waiting for the others: a peer may be gone)."""
    import torch.distributed as dist


    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() != "fake" and not failed:
            dist.barrier()
        dist.destroy_process_group()
        release_dtensor_caches()


class RankLost(RuntimeError):
    """Another rank of the run died; the message names it and where its output went."""


# Failures of a launched run that explain themselves in one line; anything else keeps its traceback.
# (FloatingPointError: the module's non-finite stop, "non-finite gradient norm nan at step 2; ...".)
RUN_FAILURES = (ConfigError, CheckpointError, RecipeError, FloatingPointError)


def _report(err: BaseException, rank: Optional[int] = None, fresh_line: bool = False) -> None:
    """The one error line; ``fresh_line``: on a line of its own (after a launch, a progress bar may
    have left its line unfinished)."""
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        traceback.print_exception(err)
    where = f"[rank {rank}] " if rank is not None else ""
    print(f"{chr(10) if fresh_line else ''}titan-lightning: error: {where}{_one_line(err)}", file=sys.stderr,
          flush=True)


@contextmanager
def held_lightning_output() -> Iterator[None]:
    """Hold what Lightning logs and warns while the run is assembled ("GPU available: ...", tips),
    and let it out only once the run is valid: an error is then the only line printed."""
    records: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if not record.name.startswith("lightning"):
            return True
        if not any(held is record for held in records):  # a record passes every handler up its chain
            records.append(record)
        return False

    # Lightning's own handlers, and any a program or a test added elsewhere (the root's, ...).
    loggers = [logging.getLogger(), *(value for value in logging.root.manager.loggerDict.values()
                                      if isinstance(value, logging.Logger))]
    handlers = list({id(h): h for logger in loggers for h in logger.handlers}.values())
    for handler in handlers:
        handler.addFilter(hold)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            yield
    finally:
        for handler in handlers:
            handler.removeFilter(hold)
    for record in records:
        logging.getLogger(record.name).handle(record)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def prepare(argv: list[str]) -> Optional[tuple[str, Run, L.Trainer]]:
    """Parse, apply overrides, validate, build the Trainer. None when only printing."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return None
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        raise UsageError(unknown_command(command))
    if command == "estimate":
        raise UsageError("estimate builds no Trainer; run it with main() or estimate_command()")
    run = parse_run(rest)
    if run is None:
        return None
    trainer = build_trainer(run)
    check_inputs(command, run, trainer)
    return command, run, trainer


def parse_run(argv: list[str]) -> Optional[Run]:
    """The recipe's run with the command line's overrides applied; None when only printing."""
    if {"-h", "--help"} & set(argv) and recipe_arg(argv) is None and _config_path(argv) is None:
        build_parser(None).print_help()  # every option, with JobConfig's and Trainer's defaults
        return None
    argv, config = read_config(argv)
    spec = _recipe_spec(argv, config)
    run = build_run(spec, {name: _option_value(argv, option, config) for name, option in RECIPE_PARAMETERS.items()})
    if config is not None:
        check_config_sections(config, run)
    parser = build_parser(run)
    try:
        namespace = parser.parse_args(argv)
    except argparse.ArgumentError as err:
        raise UsageError(_describe_parse_error(str(err), run, config)) from None
    named = named_fields(argv, config.text if config is not None else None)  # (kept by the device's choice)
    if namespace.print_config:
        namespace.print_config = False
        print(_config_text(parser, namespace, run, named, skip_none=False), end="")
        return None
    try:  # (a value YAML cannot hold, e.g. a callback object given in Python: no file; generate needs --recipe)
        text = _config_text(parser, namespace, run, named, skip_none=False)
    except Exception:  # noqa: BLE001 - jsonargparse/yaml raise their own types
        text = None
    apply_namespace(run, parser, namespace)
    run.explicit = named
    run.config_text = text  # (written into the run folder at launch: trainer.RunConfig)
    return run


def _config_text(parser: ArgumentParser, namespace, run: Run, named: set[str], skip_none: bool = True) -> str:
    """The run as --print_config prints it: the YAML that ``--config`` reproduces (with
    ``skip_none`` False, also the fields set to null where the recipe sets a value)."""
    explicit = explicit_line(run, named)
    return parser.dump(namespace, skip_validation=True, skip_none=skip_none) + (explicit + "\n" if explicit else "")


def estimate_command(argv: list[str]) -> int:
    """``estimate``: this rank's memory over one training step (titan_lightning/estimate.py)."""
    own = argparse.ArgumentParser(prog="titan-lightning estimate", add_help=False, allow_abbrev=False,
                                  exit_on_error=False)
    own.add_argument("--world_size", type=int)
    own.add_argument("--rank", type=int, default=0)
    own.add_argument("--json", action="store_true")
    try:
        options, rest = own.parse_known_args(argv)
    except argparse.ArgumentError as err:
        raise UsageError(f"estimate: {err}") from None
    if options.world_size is None and not {"--print_config", "-h", "--help"} & set(rest):
        raise UsageError("estimate needs --world_size N (the number of ranks to estimate for)")
    if options.world_size is not None and options.world_size < 1:
        raise UsageError(f"--world_size={options.world_size} must be >= 1")
    run = parse_run(rest)
    if run is None:
        return 0
    # (start-up time: estimate's fake-tensor machinery, ~0.7 s, loads for this command only)
    from titan_lightning.estimate import estimate

    result = estimate(run, options.world_size, options.rank)
    print(result.to_json() if options.json else result.table())
    return 0


def build_parser(run: Optional[Run]) -> ArgumentParser:
    """The options of ``run``, its values as defaults; without a run (``fit --help`` alone), those
    of any recipe with JobConfig's and Trainer's defaults."""
    parser = ArgumentParser(prog="titan-lightning", exit_on_error=False, default_env=False, print_config=None,
                            description=None if run is not None else
                            "Options of every recipe; add --recipe MOD:FN to see that recipe's values as defaults.")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML written by --print_config")
    parser.add_argument("--recipe", type=str, required=True, help="package.module:function")
    parser.add_argument("--print_config", action="store_true", help="print the resolved run and exit")
    job = run.job if run is not None else JobConfig()
    recipe_trainer = run.trainer if run is not None else {}
    if job is not None:
        parser.add_argument("--job", type=type(job), default=job, help="the run's JobConfig")
    # Method arguments, not class arguments: the CLI builds the Trainer itself.
    int_first = _int_or_float_args()
    skip = set(_OBJECT_ARGS) | set(int_first)
    if _kept_by_recipe("strategy", recipe_trainer.get("strategy", "auto")):
        skip.add("strategy")
    parser.add_method_arguments(L.Trainer, "__init__", "trainer", skip=skip)
    for key, default in int_first.items():
        # Trainer annotates these Union[float, int]: "4" would parse as 4.0 and "1" as 100%.
        # Annotated keeps typing's Union cache from handing back Trainer's float-first Union.
        parser.add_argument(f"--trainer.{key}", type=Optional[Union[int, Annotated[float, "fraction"]]], default=default)
    trainer_args = _trainer_signature_defaults()
    trainer_defaults = {}
    for key, value in recipe_trainer.items():
        if key not in trainer_args:
            raise RecipeError(f"recipe trainer argument {key!r} is not an argument of lightning.Trainer")
        if not _kept_by_recipe(key, value) and key not in _ADDED_ARGS:
            trainer_defaults[f"trainer.{key}"] = value
    parser.set_defaults(trainer_defaults)
    return parser


def apply_namespace(run: Run, parser: ArgumentParser, namespace) -> None:
    """Turn the parsed namespace back into the run's job config and Trainer kwargs."""
    init = _instantiate(parser, namespace)
    if run.job is not None:
        run.set_job(init.job)
    defaults = _trainer_signature_defaults()
    trainer = {k: v for k, v in run.trainer.items() if _kept_by_recipe(k, v)}
    for key, value in vars(init.trainer).items():
        if key not in defaults:
            continue  # jsonargparse bookkeeping, not a Trainer argument
        if key == "logger" and value is not None:
            trainer[key] = value
        elif key == "callbacks" and value is not None:
            trainer[key] = _as_list(trainer.get(key)) + _as_list(value)
        elif key not in _ADDED_ARGS and (key in run.trainer or value != defaults[key]):
            trainer[key] = value
    run.trainer = trainer


def _instantiate(parser: ArgumentParser, namespace):
    """``parser.instantiate``; a class on the command line that cannot be built for want of a
    package (``--trainer.logger WandbLogger`` without wandb) is one line naming the package."""
    try:
        return parser.instantiate(namespace)
    except ValueError as err:
        missing = _missing_import(err)
        if missing is None:
            raise
        class_path, error = missing
        option = next((f"trainer.{key}" for key in _ADDED_ARGS
                       if class_path in _class_paths(namespace.get(f"trainer.{key}"))), "trainer.logger")
        what = f"--{option} {class_path.rsplit('.', 1)[-1]}"
        package = _package_named(error)
        if package is None:
            raise UsageError(f"{what}: {_one_line(error)}") from None
        raise UsageError(f"{what} needs the {package} package: pip install {package}") from None


def _missing_import(err: BaseException) -> Optional[tuple[str, ImportError]]:
    """(the class path, the ImportError its construction raised) in jsonargparse's chain of
    errors, if there is one."""
    class_path, seen = None, set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        named = re.search(r"Problem with given class_path '([^']+)'", str(err))
        class_path = named.group(1) if named else class_path
        if isinstance(err, ImportError) and class_path is not None:
            return class_path, err
        err = err.__cause__ or err.__context__
    return None


def _class_paths(value) -> list:
    return [getattr(item, "class_path", None) for item in _as_list(value)]


def _package_named(error: ImportError) -> Optional[str]:
    """The package an ImportError asks for: its module (``No module named 'wandb'``), or the
    requirement Lightning's loggers name (``Requirement 'wandb>=0.12.10' not met``)."""
    if error.name:
        return error.name.split(".")[0]
    named = re.search(r"Requirement '([A-Za-z0-9_.-]+)|No module named '([A-Za-z0-9_-]+)|Module not found: '([A-Za-z0-9_-]+)",
                      str(error))
    return next((group for group in named.groups() if group), None) if named else None


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _kept_by_recipe(key: str, value) -> bool:
    """Objects a recipe sets stay as they are; the command line replaces (logger) or adds to
    (callbacks) some of them, and neither shows nor overrides the others."""
    return key in _OBJECT_ARGS or key in _ADDED_ARGS or (key == "strategy" and not isinstance(value, str))


def _trainer_signature_defaults() -> dict:
    parameters = inspect.signature(L.Trainer.__init__).parameters
    return {name: p.default for name, p in parameters.items() if name != "self"}


def _int_or_float_args() -> dict:
    parameters = inspect.signature(L.Trainer.__init__).parameters
    return {
        name: p.default for name, p in parameters.items()
        if set(typing.get_args(p.annotation)) >= {int, float}
    }


def _recipe_spec(argv: list[str], config: Optional["ConfigFile"]) -> str:
    spec = recipe_arg(argv)
    if spec is not None:
        return spec
    if config is not None:
        if isinstance(config.data.get("recipe"), str) and config.data["recipe"]:
            return config.data["recipe"]
        raise UsageError(f"{config.where} names no recipe; add 'recipe: package.module:function'")
    raise UsageError(RECIPE_REQUIRED)


def _option_value(argv: list[str], option: str, config: Optional["ConfigFile"]) -> Optional[str]:
    """The last value of ``--option`` on the command line, else the one of the --config file."""
    value = None
    for i, arg in enumerate(argv):
        if arg == f"--{option}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"--{option}="):
            value = arg.split("=", 1)[1]
    if value is None and config is not None:
        saved = config.data
        for key in option.split("."):
            saved = saved.get(key) if isinstance(saved, dict) else None
        value = saved if isinstance(saved, str) else None
    return value


def _config_path(argv: list[str]) -> Optional[str]:
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise UsageError("--config needs a file (a YAML written by --print_config)")
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


# How long --config may stay silent when it is a pipe: ``<(command)`` has a writer that may take a
# moment; a FIFO nobody writes to would otherwise be waited on forever.
CONFIG_PIPE_WAIT_S = 10.0


@dataclass
class ConfigFile:
    """The --config file, read once: a pipe (``--config <(cat run.yaml)``) can be read only once,
    so the parser gets its text, never the path again."""

    path: str
    text: str
    data: dict

    @property
    def where(self) -> str:
        return f"--config={self.path!r}"

    def at(self, key: str) -> str:
        """``--config='run.yaml', line 3`` for the line of ``key`` (dotted), if it is there."""
        line = _yaml_line(self.text, key)
        return f"{self.where}, line {line}" if line is not None else self.where


def read_config(argv: list[str]) -> tuple[list[str], Optional[ConfigFile]]:
    """``argv`` with the --config file's text in place of its path, and that file; (argv, None)
    without --config."""
    path = _config_path(argv)
    if path is None:
        return argv, None
    text = _read_text(path)
    config = ConfigFile(path, text, _parse_yaml(path, text))
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            # One argument, --config=TEXT: a text starting with "---" would read as an option.
            width = 2 if arg == "--config" else 1
            return [*argv[:i], f"--config={text}", *argv[i + width:]], config
    return argv, config


def _read_text(path: str) -> str:
    """The text of --config: a file, or a pipe read until its writer closes it. Never blocks
    for longer than CONFIG_PIPE_WAIT_S without data: a FIFO with no writer is refused."""
    where = f"--config={path!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open would wait for a writer
    except OSError as err:
        raise UsageError(f"{where}: {err.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise UsageError(f"{where}: Is a directory; give a YAML file (--print_config writes one)")
        data = _read_regular(fd) if stat.S_ISREG(mode) else _read_stream(fd, where)
    except OSError as err:
        raise UsageError(f"{where}: {err.strerror}") from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"{where} is not UTF-8 text (byte {err.start}); give a YAML file") from None


def _read_regular(fd: int) -> bytes:
    os.set_blocking(fd, True)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _read_stream(fd: int, where: str) -> bytes:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    chunks = []
    while True:
        if not poller.poll(CONFIG_PIPE_WAIT_S * 1000):
            raise UsageError(f"{where}: nothing to read for {CONFIG_PIPE_WAIT_S:g} s (a FIFO with no writer?); "
                             f"give a YAML file, or <(command) with a command that writes one")
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            continue
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _parse_yaml(path: str, text: str) -> dict:
    """The YAML of --config: a mapping (an empty file reads as {})."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UsageError(f"--config={path!r}{where}: not valid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config={path!r} holds {_yaml_value(data)}, not a mapping; give a YAML file of "
                         f"recipe, job and trainer as --print_config writes it")
    return data


def check_config_sections(config: ConfigFile, run: Run) -> None:
    """Every section of the --config file that holds fields (``job``, ``job.training``, ...,
    ``trainer``) is a mapping: a scalar or null there would replace the recipe's whole section
    with the defaults."""
    data = config.data
    if "trainer" in data and not isinstance(data["trainer"], dict):
        raise UsageError(f"{config.at('trainer')}: trainer={_yaml_value(data['trainer'])} must be a mapping of "
                         f"lightning.Trainer arguments (e.g. max_steps: 100), as --print_config writes it")
    if "job" in data and run.job is not None:
        _check_section(config, "job", data["job"], run.job, type(run.job), optional=False)


def _check_section(config: ConfigFile, key: str, value: Any, current: Any, cls: type, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, dict):
        fields = ", ".join(f.name for f in dataclasses.fields(cls))
        raise UsageError(f"{config.at(key)}: {key}={_yaml_value(value)} must be a mapping of {fields}"
                         f"{' (or null)' if optional else ''}, as --print_config writes it")
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name not in value:
            continue
        child = getattr(current, field.name, None)
        child_cls, child_optional = section_type(hints.get(field.name))
        if dataclasses.is_dataclass(child) and not isinstance(child, type):
            child_cls = type(child)  # a family narrows a field's type (job.model)
        if child_cls is not None:
            _check_section(config, f"{key}.{field.name}", value[field.name], child, child_cls, child_optional)


def _yaml_value(value: Any) -> str:
    return json.dumps(value, default=str)


def _yaml_line(text: str, key: str) -> Optional[int]:
    """The line of ``key`` (dotted: job.training.seed) in the YAML ``text``, if it is there."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in key.split("."):
        if not isinstance(node, yaml.MappingNode):
            return line
        for name, value in node.value:
            if name.value == part:
                line, node = name.start_mark.line + 1, value
                break
        else:
            return line
    return line


def _describe_parse_error(message: str, run: Run, config: Optional[ConfigFile] = None) -> str:
    unknown = re.search(r"unrecognized arguments: (\S+)", message)
    if unknown:
        option = unknown.group(1).split("=", 1)[0]
        return f"unknown option {option}; {_valid_keys_near(option, run)}"
    key = re.search(r'(?:Parser key|Key) "([^"]+)"', message)
    name = key.group(1) if key else None
    group = re.search(r"Group '([^']+)' does not accept option '([^']+)'", message)
    if group:
        name = f"{group.group(1)}.{group.group(2)}"
        message = f"unknown key {name}; {_valid_keys_near(name, run)}"
    if name in _CLASS_EXAMPLES:
        message = _describe_class_error(name, message)
    typed = re.search(r"Expected a <class '(\w+)'>\. Got value: (.+)", message)
    if typed and name is not None:
        message = " ".join(message.split()) + "; " + _expected_value(name, typed.group(1), typed.group(2), run)
    top = re.search(r"Option '([^']+)' is not accepted", message)
    if top and config is not None:
        return f"{config.at(top.group(1))}: unknown key {top.group(1)}; valid keys: recipe, job, trainer"
    if config is not None and name is not None:
        # A value from the config file (a command-line override of the same key would have won).
        line = _yaml_line(config.text, name)
        if line is not None:
            return f"{config.where}, line {line}: {message}"
    return message


_CLASS_EXAMPLES = {
    "trainer.logger": "lightning.pytorch.loggers.CSVLogger --trainer.logger.save_dir logs",
    "trainer.callbacks": "lightning.pytorch.callbacks.LearningRateMonitor",
}


def _describe_class_error(name: str, message: str) -> str:
    """jsonargparse's tried-every-Union-member report, cut to the class that was meant."""
    problem = re.search(r"Problem with given class_path '([^']+)':\s*\n\s*(.+)", message)
    if problem:
        return f"{name}={problem.group(1)}: {problem.group(2).strip()}"
    given = re.search(r"Given value: (.+)", message)
    value = given.group(1).strip() if given else "the value"
    return f"{name}: {value!r} is not a class path; e.g. --{name} {_CLASS_EXAMPLES[name]}"


_KINDS = {"float": "a number", "int": "an integer", "bool": "true or false", "str": "a string"}


def _expected_value(name: str, kind: str, given: str, run: Run) -> str:
    """What a field of type ``kind`` takes, with the run's own value as the example."""
    what = _KINDS.get(kind, kind)
    if kind == "float" and given.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
        what = "a finite number"
    node: Any = run.job if name.startswith("job.") else None
    for part in name.split(".")[1:]:
        node = getattr(node, part, None)
    example = f" (the recipe's: {node})" if node is not None and not dataclasses.is_dataclass(node) else ""
    return f"give {what}{example}"


def _valid_keys_near(option: str, run: Run) -> str:
    parts = option.lstrip("-").split(".")
    if parts[0] == "job" and run.job is not None:
        node, path = run.job, ["job"]
        for part in parts[1:-1]:
            child = getattr(node, part, None)
            if not dataclasses.is_dataclass(child):
                break
            node, path = child, path + [part]
        fields = [f.name for f in dataclasses.fields(node)]
        return f"valid keys under {'.'.join(path)}: {', '.join(fields)}"
    if parts[0] == "trainer":
        return "valid keys under trainer: the arguments of lightning.Trainer"
    return f"valid options: {', '.join(OPTIONS)}"


# Errors whose message is written for the user (it names the field); others get their type too.
_OWN_MESSAGES = (UsageError, RecipeError, ConfigError, CheckpointError, RankLost, ValueError, TypeError, OSError)


def _one_line(err: BaseException) -> str:
    text = str(err)
    text = re.sub(r'Parser key "([^"]+)":\s*', r"\1: ", text)
    text = " ".join(text.split())
    if not isinstance(err, _OWN_MESSAGES) or isinstance(err, (KeyError, AttributeError)) or not text:
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
        if os.environ.get(DEBUG_ENV, "") in ("", "0"):
            text += f" ({DEBUG_ENV}=1 shows the traceback)"
    return text


if __name__ == "__main__":
    sys.exit(main())
