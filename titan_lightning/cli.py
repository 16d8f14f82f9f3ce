"""``titan-lightning fit|validate|test|estimate --recipe package.module:function [overrides]``.

Options (frozen by tests/unit_tests/cpu/test_cli.py; new knobs go into the configs):

    --recipe MOD:FN      the run to start from
    --config FILE        a YAML file written by --print_config (it names its recipe)
    --print_config       print the fully resolved run as YAML and exit
    --job.SECTION.FIELD  override a JobConfig field (model, training, parallelism, ...)
    --trainer.ARG        override a lightning.Trainer argument

``estimate`` takes the same options and overrides, plus its own (see titan_lightning/estimate.py):

    --world_size N       the world to estimate for (required)
    --rank R             the rank to simulate (default 0)
    --json               print bytes as JSON instead of the table in GiB

Bad input exits with status 2 and one line on stderr, before anything is written.
"""

import argparse
import dataclasses
import inspect
import re
import sys
import typing
from typing import Annotated, Optional, Sequence, Union

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser

import lightning as L

from titan_lightning.recipe import Run, RecipeError, build_run, build_trainer, execute

SUBCOMMANDS = ("fit", "validate", "test", "estimate")
OPTIONS = ("--recipe", "--config", "--print_config", "--job", "--trainer")
# Trainer arguments that hold objects: a recipe sets them, the command line does not.
# (`strategy` is on the command line as a registry name or a class path, see build_parser.)
_OBJECT_ARGS = ("callbacks", "logger", "plugins")


class UsageError(ValueError):
    """Bad command-line input; reported as one line with exit status 2."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "estimate":
            return estimate_command(argv[1:])
        prepared = prepare(argv)
    except (UsageError, ValueError, TypeError) as err:
        print(f"titan-lightning: error: {_one_line(err)}", file=sys.stderr)
        return 2
    if prepared is None:
        return 0
    command, run, trainer = prepared
    execute(command, run, trainer)
    return 0


def prepare(argv: list[str]) -> Optional[tuple[str, Run, L.Trainer]]:
    """Parse, apply overrides, validate, build the Trainer. None when only printing."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return None
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        raise UsageError(f"unknown command {command!r}; expected one of {', '.join(SUBCOMMANDS)}")
    if command == "estimate":
        raise UsageError("estimate builds no Trainer; run it with main() or estimate_command()")
    run = parse_run(rest)
    if run is None:
        return None
    return command, run, build_trainer(run)


def parse_run(argv: list[str]) -> Optional[Run]:
    """The recipe's run with the command line's overrides applied; None when only printing."""
    spec = _recipe_spec(argv)
    run = build_run(spec)
    parser = build_parser(run)
    try:
        namespace = parser.parse_args(argv)
    except argparse.ArgumentError as err:
        raise UsageError(_describe_parse_error(str(err), run)) from None
    if namespace.print_config:
        namespace.print_config = False
        print(parser.dump(namespace, skip_validation=True), end="")
        return None
    apply_namespace(run, parser, namespace)
    return run


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
    if options.world_size is None and "--print_config" not in rest:
        raise UsageError("estimate needs --world_size N (the number of ranks to estimate for)")
    if options.world_size is not None and options.world_size < 1:
        raise UsageError(f"--world_size={options.world_size} must be >= 1")
    run = parse_run(rest)
    if run is None:
        return 0
    from titan_lightning.estimate import estimate

    result = estimate(run, options.world_size, options.rank)
    print(result.to_json() if options.json else result.table())
    return 0


def build_parser(run: Run) -> ArgumentParser:
    parser = ArgumentParser(prog="titan-lightning", exit_on_error=False, default_env=False, print_config=None)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML written by --print_config")
    parser.add_argument("--recipe", type=str, required=True, help="package.module:function")
    parser.add_argument("--print_config", action="store_true", help="print the resolved run and exit")
    if run.job is not None:
        parser.add_argument("--job", type=type(run.job), default=run.job, help="the run's JobConfig")
    # Method arguments, not class arguments: the CLI builds the Trainer itself.
    int_first = _int_or_float_args()
    skip = set(_OBJECT_ARGS) | set(int_first)
    if _kept_by_recipe("strategy", run.trainer.get("strategy", "auto")):
        skip.add("strategy")
    parser.add_method_arguments(L.Trainer, "__init__", "trainer", skip=skip)
    for key, default in int_first.items():
        # Trainer annotates these Union[float, int]: "4" would parse as 4.0 and "1" as 100%.
        # Annotated keeps typing's Union cache from handing back Trainer's float-first Union.
        parser.add_argument(f"--trainer.{key}", type=Optional[Union[int, Annotated[float, "fraction"]]], default=default)
    trainer_args = _trainer_signature_defaults()
    trainer_defaults = {}
    for key, value in run.trainer.items():
        if key not in trainer_args:
            raise RecipeError(f"recipe trainer argument {key!r} is not an argument of lightning.Trainer")
        if not _kept_by_recipe(key, value):
            trainer_defaults[f"trainer.{key}"] = value
    parser.set_defaults(trainer_defaults)
    return parser


def apply_namespace(run: Run, parser: ArgumentParser, namespace) -> None:
    """Turn the parsed namespace back into the run's job config and Trainer kwargs."""
    init = parser.instantiate(namespace)
    if run.job is not None:
        run.set_job(init.job)
    defaults = _trainer_signature_defaults()
    trainer = {k: v for k, v in run.trainer.items() if _kept_by_recipe(k, v)}
    for key, value in vars(init.trainer).items():
        if key not in defaults:
            continue  # jsonargparse bookkeeping, not a Trainer argument
        if key in run.trainer or value != defaults[key]:
            trainer[key] = value
    run.trainer = trainer


def _kept_by_recipe(key: str, value) -> bool:
    """Objects a recipe sets stay as they are; the command line neither shows nor overrides them."""
    return key in _OBJECT_ARGS or (key == "strategy" and not isinstance(value, str))


def _trainer_signature_defaults() -> dict:
    parameters = inspect.signature(L.Trainer.__init__).parameters
    return {name: p.default for name, p in parameters.items() if name != "self"}


def _int_or_float_args() -> dict:
    parameters = inspect.signature(L.Trainer.__init__).parameters
    return {
        name: p.default for name, p in parameters.items()
        if set(typing.get_args(p.annotation)) >= {int, float}
    }


def _recipe_spec(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--recipe" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--recipe="):
            return arg.split("=", 1)[1]
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else arg.split("=", 1)[1] if arg.startswith("--config=") else None
        if path is not None:
            try:
                with open(path) as f:
                    saved = yaml.safe_load(f) or {}
            except OSError as err:
                raise UsageError(f"--config={path!r}: {err.strerror}") from None
            if isinstance(saved, dict) and saved.get("recipe"):
                return saved["recipe"]
            raise UsageError(f"--config={path!r} names no recipe; add 'recipe: package.module:function'")
    raise UsageError("--recipe is required (e.g. --recipe recipes.llama3:debugmodel)")


def _describe_parse_error(message: str, run: Run) -> str:
    unknown = re.search(r"unrecognized arguments: (\S+)", message)
    if unknown:
        option = unknown.group(1).split("=", 1)[0]
        return f"unknown option {option}; {_valid_keys_near(option, run)}"
    return message


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


def _one_line(err: BaseException) -> str:
    text = str(err)
    text = re.sub(r'Parser key "([^"]+)":\s*', r"\1: ", text)
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
