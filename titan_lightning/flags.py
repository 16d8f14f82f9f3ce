"""The command line's shape, checked before torch and Lightning load.

Importing torch and Lightning takes 5-40 s on a busy 2-core machine; a misspelt flag should not
wait for them. ``refusal`` tells, from the arguments alone, the one-line error titan_lightning/cli.py
would give after those imports: an unknown command, a missing or malformed ``--recipe``, a recipe
module that is not there, an option outside ``OPTIONS``, a ``--job.SECTION.FIELD`` that is not a
field of the config dataclasses, a ``--trainer.ARG`` that is not a ``lightning.Trainer`` argument,
and a word where a Trainer argument takes an integer. Where the answer needs the recipe's run
(``job.model``'s fields belong to the family, the recipe's values make the examples, a ``--config``
file holds the rest) it says nothing and the full command line decides. The keys known are
JobConfig's (a family's job narrows only ``model``) and those of the pinned Lightning's Trainer.
tests/unit_tests/cpu/test_fast_refusal.py holds both to the same messages.

Imports here: the standard library and titan_lightning.config (dataclasses only).
"""

import dataclasses
import importlib.machinery
import importlib.util
import os
import re
import types
import typing
from typing import Any, Optional, Sequence, Union

from titan_lightning.config import JobConfig

SUBCOMMANDS = ("fit", "validate", "test", "estimate", "prepare", "generate", "chat")
OPTIONS = ("--recipe", "--config", "--print_config", "--job", "--trainer")
# Commands whose options are their own (titan_lightning/data/prepare.py, generate.py).
OWN_OPTIONS = ("prepare", "generate", "chat")
RECIPE_REQUIRED = "--recipe is required (e.g. --recipe recipes.llama3:debugmodel)"

# lightning.Trainer's arguments, in its signature's order (a test keeps this equal to
# inspect.signature(lightning.Trainer)); the ones annotated a plain int.
TRAINER_ARGS = (
    "accelerator", "strategy", "devices", "num_nodes", "precision", "logger", "callbacks", "fast_dev_run",
    "max_epochs", "min_epochs", "max_steps", "min_steps", "max_time", "limit_train_batches", "limit_val_batches",
    "limit_test_batches", "limit_predict_batches", "overfit_batches", "val_check_interval",
    "check_val_every_n_epoch", "num_sanity_val_steps", "log_every_n_steps", "enable_checkpointing",
    "enable_progress_bar", "enable_model_summary", "accumulate_grad_batches", "gradient_clip_val",
    "gradient_clip_algorithm", "deterministic", "benchmark", "inference_mode", "use_distributed_sampler", "profiler",
    "detect_anomaly", "barebones", "plugins", "sync_batchnorm", "reload_dataloaders_every_n_epochs",
    "default_root_dir", "enable_autolog_hparams", "model_registry",
)
TRAINER_INT_ARGS = ("num_nodes", "max_steps", "accumulate_grad_batches", "reload_dataloaders_every_n_epochs")
# A Trainer argument the command line never offers (cli._OBJECT_ARGS: objects a recipe sets).
_NEVER_ON_COMMAND_LINE = ("plugins",)

# estimate's own options (cli.estimate_command): those taking a value, and --json.
_ESTIMATE_VALUE_OPTIONS = ("--world_size", "--rank")
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse's: a value, not an option
_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")
_INTEGER = re.compile(r"^[-+]?\d+$")


def refusal(argv: Sequence[str]) -> Optional[str]:
    """The one-line error (without the ``titan-lightning: error:`` prefix) the command line gives
    for ``argv``, where the arguments alone tell it; None where the full command line decides."""
    if not argv or argv[0] in ("-h", "--help"):
        return None
    command, rest = argv[0], list(argv[1:])
    if command not in SUBCOMMANDS:
        return unknown_command(command)
    if command in OWN_OPTIONS:
        return None
    if command == "estimate":
        rest = _without_estimate_options(rest)
        if rest is None:
            return None
    if {"-h", "--help"} & set(rest) or any(a == "--config" or a.startswith("--config=") for a in rest):
        return None  # help, or a --config file whose text comes first
    spec = recipe_arg(rest)
    if spec is None:
        return RECIPE_REQUIRED
    return _recipe_refusal(spec) or _option_refusal(rest)


def unknown_command(command: str) -> str:
    return f"unknown command {command!r}; expected one of {', '.join(SUBCOMMANDS)}"


def section_type(hint: Any) -> tuple[Optional[type], bool]:
    """(the dataclass a field holds, whether it may be None), or (None, False) for other fields."""
    optional = False
    if typing.get_origin(hint) in (Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(members) < len(typing.get_args(hint))
        hint = members[0] if len(members) == 1 else None
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint, optional
    return None, False


def _without_estimate_options(argv: list[str]) -> Optional[list[str]]:
    """``argv`` without estimate's own options; None where those are wrong or missing (its own
    messages, cli.estimate_command)."""
    rest, world_size, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in _ESTIMATE_VALUE_OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    return None
                i, value = i + 1, argv[i + 1]
            if not _INTEGER.match(value):
                return None
            world_size = int(value) if name == "--world_size" else world_size
        elif arg != "--json":
            rest.append(arg)
        i += 1
    if world_size is None or world_size < 1:
        return None
    return rest


def recipe_arg(argv: Sequence[str]) -> Optional[str]:
    """The first ``--recipe`` value."""
    for i, arg in enumerate(argv):
        if arg == "--recipe" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--recipe="):
            return arg.split("=", 1)[1]
    return None


def _recipe_refusal(spec: str) -> Optional[str]:
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        return f"--recipe={spec!r} must look like package.module:function (e.g. recipes.llama3:debugmodel)"
    missing = _missing_module(module_name)
    return f"--recipe={spec!r}: no module named {missing!r}" if missing is not None else None


def _missing_module(module_name: str) -> Optional[str]:
    """The first part of ``module_name`` that importing it would not find (as ModuleNotFoundError
    names it), found without running any of it; None where it is there, or where only importing
    can tell. The current folder is searched first, as cli.py's import of a recipe does."""
    parts = module_name.split(".")
    if not all(_IDENTIFIER.match(part) for part in parts):
        return None
    spec = importlib.machinery.PathFinder.find_spec(parts[0], [os.getcwd()])
    if spec is None:
        try:
            spec = importlib.util.find_spec(parts[0])  # every finder of sys.meta_path (editable installs, ...)
        except (ImportError, ValueError):
            return None
    if spec is None:
        return parts[0]
    for i in range(1, len(parts)):
        if spec.submodule_search_locations is None:
            return ".".join(parts[:i + 1])  # (importing it: "No module named 'a.b'; 'a' is not a package")
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), list(spec.submodule_search_locations))
        if spec is None:
            return ".".join(parts[:i + 1])
    return None


def _option_refusal(argv: list[str]) -> Optional[str]:
    """What the full command line says first about ``argv``'s options: a word given to a Trainer
    argument that takes an integer (jsonargparse checks values before it lists unknown options),
    else the first option that is none (cli._describe_parse_error's message)."""
    known, holders = _known_options()
    options = []  # (name, value, unknown)
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--" or _NEGATIVE_NUMBER.match(arg):
            return None  # argparse's own reading of these: the full command line says what it is
        name, eq, value = arg.partition("=") if arg.startswith("-") else (arg, "", "")
        unknown = _is_unknown(name, known, holders)
        if not eq and arg.startswith("--") and name != "--print_config":  # the value is the next argument
            if i < len(argv) and (not argv[i].startswith("-") or _NEGATIVE_NUMBER.match(argv[i])):
                value, i = argv[i], i + 1
            elif not unknown:
                return None  # "expected one argument": argparse's message
        options.append((name, value, unknown))
    for name, value, _ in options:
        arg = name[len("--trainer."):] if name.startswith("--trainer.") else None
        if arg in TRAINER_INT_ARGS and _is_word(value):
            return f"trainer.{arg}: Expected a <class 'int'>. Got value: {value}; give an integer"
    for name, _, unknown in options:
        if unknown:
            return _describe_unknown(name)
    return None


# YAML's words for booleans and null (jsonargparse reads values as YAML; these are no strings).
_YAML_WORDS = {"y", "yes", "n", "no", "true", "false", "on", "off", "null"}


def _is_word(value: str) -> bool:
    """A value jsonargparse keeps as the string given: a word, not a number, boolean or null."""
    return re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", value) is not None and value.lower() not in _YAML_WORDS


def _known_options() -> tuple[set[str], set[str]]:
    """The option strings the full command line offers whatever the recipe (but for those under
    ``--job.model``: the family's), and those of them that hold keys of their own below them
    (``--trainer.logger.save_dir``, ``--job.model.dim``: the class or the family tells which)."""
    sections, leaves = _job_options(JobConfig, "--job")
    trainer = {f"--trainer.{arg}" for arg in TRAINER_ARGS if arg not in _NEVER_ON_COMMAND_LINE}
    return {*OPTIONS, "--help", *sections, *leaves, *trainer}, {*leaves, "--job.model", *trainer}


def _job_options(cls: type, prefix: str) -> tuple[list[str], list[str]]:
    """(the sections, the fields) of the dataclass ``cls`` as options, below ``prefix``."""
    sections, leaves = [], []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        option = f"{prefix}.{field.name}"
        child, _ = section_type(hints.get(field.name))
        if child is None or option == "--job.model":
            leaves.append(option)
            continue
        sections.append(option)
        below = _job_options(child, option)
        sections += below[0]
        leaves += below[1]
    return sections, leaves


def _is_unknown(name: str, known: set[str], holders: set[str]) -> bool:
    """No option is ``name``, none holds it and none starts with it (argparse takes a prefix of
    one option for that option)."""
    if not name.startswith("--"):
        return True
    if name in known or any(name.startswith(option + ".") or name.startswith(option + "+") for option in holders):
        return False
    return not any(option.startswith(name) for option in known)  # (an ambiguous prefix: argparse's message)


def _describe_unknown(name: str) -> Optional[str]:
    """cli._valid_keys_near's words for ``name``; None below ``job.model`` (the family's keys)."""
    parts = name[2:].split(".")
    if parts[0] == "job":
        cls, path = JobConfig, ["job"]
        for part in parts[1:-1]:
            if path == ["job"] and part == "model":
                return None
            child, _ = section_type(typing.get_type_hints(cls).get(part))
            if child is None:
                break
            cls, path = child, path + [part]
        fields = ", ".join(f.name for f in dataclasses.fields(cls))
        return f"unknown option {name}; valid keys under {'.'.join(path)}: {fields}"
    if parts[0] == "trainer":
        return f"unknown option {name}; valid keys under trainer: the arguments of lightning.Trainer"
    return f"unknown option {name}; valid options: {', '.join(OPTIONS)}"
