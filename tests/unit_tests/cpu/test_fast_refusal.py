"""A bad flag is refused before torch and Lightning load (titan_lightning/flags.py), with the line
the full command line (titan_lightning/cli.py) gives for it; benchmarks/cli_startup.py times both."""

import dataclasses
import inspect
import subprocess
import sys

import lightning as L
import pytest

from titan_lightning import cli, flags
from titan_lightning.generate import COMMANDS as GENERATE_COMMANDS
from titan_lightning.recipe import build_run
from titan_lightning.trainer import RUN_DIR_ENV

D = ["fit", "--recipe", "recipes.llama3:debugmodel"]

# One of each kind the cheap check refuses; the full command line must say the same.
BAD = [
    ["train", "--recipe", "recipes.llama3:debugmodel"],
    ["fit", "--trainer.max_steps", "3"],
    ["fit", "--recipe", "recipes"],
    ["fit", "--recipe", "no_such_module:x"],
    ["fit", "--recipe", "recipes.no_such_module:x"],
    [*D, "--foo", "1"],
    [*D, "--print_config", "stray"],
    [*D, "--job.training.sequence_len", "5"],
    [*D, "--job.trainin.seed", "5"],
    [*D, "--job.quantize.float8.enbl", "true"],
    [*D, "--trainer.max_stepz=3"],
    [*D, "--trainer.plugins", "x"],
    [*D, "--job.optimizer.lr", "1e-3", "--trainer.max_steps", "ten"],
    ["estimate", "--world_size", "2", *D[1:], "--trainer.max_stepz", "3"],
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    return tmp_path


def test_trainer_args_are_lightning_trainer_s():
    parameters = inspect.signature(L.Trainer.__init__).parameters
    assert flags.TRAINER_ARGS == tuple(name for name in parameters if name != "self")
    assert flags.TRAINER_INT_ARGS == tuple(name for name, p in parameters.items() if p.annotation is int)


def test_commands_and_options_are_the_command_line_s():
    assert cli.SUBCOMMANDS is flags.SUBCOMMANDS and cli.OPTIONS is flags.OPTIONS
    assert set(GENERATE_COMMANDS) <= set(flags.OWN_OPTIONS) <= set(flags.SUBCOMMANDS)


def test_job_options_are_those_of_the_parser():
    """Every --job option the full parser offers but those of the family's job.model (and
    jsonargparse's --*.help), and no other; those with no option below them hold their own keys."""
    parser = cli.build_parser(build_run("recipes.llama3:debugmodel"))
    options = {option for action in parser._actions for option in action.option_strings
               if option.startswith("--job.") and not option.startswith("--job.model.") and not option.endswith(".help")}
    theirs = {option for option in options if not option.endswith("+")}  # (--job.data.sources+ appends to a list)
    known, holders = flags._known_options()
    assert {option for option in known if option.startswith("--job.")} == theirs
    leaves = {option for option in theirs if not any(other.startswith(option + ".") for other in theirs)}
    assert {option for option in holders if option.startswith("--job.")} == leaves
    assert {option[:-1] for option in options if option.endswith("+")} <= leaves


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(argv[3:] or argv[:3]) for argv in BAD])
def test_refusal_is_the_full_command_line_s_line(argv, workdir, capfd):
    message = flags.refusal(argv)
    assert message is not None
    assert cli.main(argv) == 2
    assert capfd.readouterr().err.strip() == f"titan-lightning: error: {message}"


@pytest.mark.parametrize("argv", [
    [*D, "--trainer.max_steps", "3", "--job.training.seq_len=128", "--job.model.dim", "64"],
    [*D, "--trainer.callbacks+", "lightning.pytorch.callbacks.LearningRateMonitor", "--trainer.logger.save_dir", "x"],
    [*D, "--print_conf", "--job.training.se", "1", "--rec", "x"],  # argparse takes a prefix of one option for it
    [*D, "--job.training.seed", "-1", "--job.training.seed", "abc"],  # a job value's example is the recipe's
    [*D, "--job.model.no_such_field", "1"],  # the family's fields: the recipe tells
    [*D, "--config", "run.yaml", "--foo", "1"],  # the file's own lines come first
    [*D, "--foo", "--help"],
    ["fit", "--recipe", "recipes.llama3:no_such_function"],
    ["estimate", *D[1:]],  # estimate's own message (--world_size)
    ["prepare", "--foo"],
    ["generate", "--foo"],
    [],
])
def test_refusal_leaves_to_the_full_command_line_what_the_arguments_do_not_tell(argv):
    assert flags.refusal(argv) is None


def test_a_bad_flag_is_refused_before_torch_and_lightning_load(tmp_path):
    code = ("import sys; from titan_lightning.entry import main; rc = main(sys.argv[1:]); "
            "print(sorted(m for m in ('torch', 'lightning', 'jsonargparse') if m in sys.modules)); sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code, *D, "--job.training.sequence_len", "5"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stdout.strip() == "[]"
    assert result.stderr.startswith("titan-lightning: error: unknown option --job.training.sequence_len; valid keys "
                                    "under job.training: seed, seq_len,")
