"""What a Lightning user types works on titan-lightning too: help without a recipe, loggers and
callbacks as class paths, a recipe module in the current folder, a step-limited progress bar,
``| head``. Each habit runs the real console script; the processes start together at the top (the
import is most of their time) and each test reads its own."""

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_lightning import cli
from titan_lightning.trainer import RUN_DIR_ENV

TIMEOUT = 120

# A user's own recipe, in the folder they run from: its own logger and callback, two tiny steps.
MY_RECIPES = '''
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from recipes.llama3 import debugmodel


class Marker(Callback):
    def on_train_end(self, trainer, pl_module):
        Path("recipe_callback_ran").write_text(str(trainer.global_step))


def tiny():
    run = debugmodel()
    run.job.model.n_layers = 1
    run.job.lr_schedule.warmup_steps = 1
    run.trainer.update(max_steps=2, logger=CSVLogger("recipe_logs"), callbacks=[Marker()], limit_val_batches=0,
                       num_sanity_val_steps=0, enable_checkpointing=False)
    return run
'''



def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


TENSORBOARD = _installed("tensorboard") or _installed("tensorboardX")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != RUN_DIR_ENV}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return env


def _start(command, cwd: Path) -> subprocess.Popen:
    shell = isinstance(command, str)  # a pipeline, in bash for pipefail
    return subprocess.Popen(command, cwd=cwd, env=_env(), shell=shell, executable="/bin/bash" if shell else None,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The console-script runs of this file, started together; ``runs(name)`` waits for one."""
    user = tmp_path_factory.mktemp("user_folder")
    (user / "my_recipes.py").write_text(MY_RECIPES)
    help_dir = tmp_path_factory.mktemp("help")
    loggers = ["--trainer.logger+", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", "cli_logs"]
    if TENSORBOARD:
        loggers += ["--trainer.logger+", "lightning.pytorch.loggers.TensorBoardLogger",
                    "--trainer.logger.save_dir", "cli_logs"]
    started = {
        "--help | head -1": _start("set -o pipefail; titan-lightning --help | head -1", help_dir),
        "fit --help | head -1": _start("set -o pipefail; titan-lightning fit --help | head -1", help_dir),
        # The user's folder, the user's recipe; loggers and callbacks from the command line.
        "my_recipes": _start(["titan-lightning", "fit", "--recipe", "my_recipes:tiny", "--trainer.accelerator", "cpu",
                              *loggers, "--trainer.callbacks+", "lightning.pytorch.callbacks.LearningRateMonitor",
                              "--trainer.callbacks+=lightning.pytorch.callbacks.Timer"], user),
    }
    finished = {}

    def wait(name):
        if name not in finished:
            out, err = started[name].communicate(timeout=TIMEOUT)
            finished[name] = subprocess.CompletedProcess(name, started[name].returncode, out, err)
        return finished[name], user if name == "my_recipes" else help_dir

    yield wait
    for process in started.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


# -- help and | head ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, first_line", [
    ("--help | head -1", "``titan-lightning fit|validate|test|estimate"),
    ("fit --help | head -1", "usage: titan-lightning [--config CONFIG] --recipe RECIPE"),  # no --recipe given
])
def test_help_needs_no_recipe_and_head_ends_it_quietly(runs, name, first_line):
    result, _ = runs(name)
    # pipefail: titan-lightning's own status, 1 if head left before the last write (Python's advice)
    assert result.returncode in (0, 1), result.stderr
    assert result.stdout.startswith(first_line) and result.stdout.count("\n") == 1, result.stdout
    assert result.stderr == ""


def test_fit_help_lists_every_option_group(capsys):
    assert cli.main(["fit", "--help"]) == 0
    shown = capsys.readouterr().out
    for option in ("--recipe", "--config", "--print_config", "--job.training.seed", "--job.parallelism.tp",
                   "--trainer.max_steps", "--trainer.logger", "--trainer.callbacks"):
        assert option in shown, option


def test_a_pipe_closed_before_anything_is_written_exits_1_quietly(monkeypatch, capfd):
    """What ``titan-lightning --help | true`` meets: Python's advice, output to devnull, no traceback."""
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        assert cli.main(["--help"]) == 1
    assert capfd.readouterr().err == ""


# -- a user's recipe module in the current folder, loggers and callbacks, the progress bar -------


def test_a_recipe_module_in_the_current_folder_loads(runs):
    result, folder = runs("my_recipes")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in result.stderr


def test_command_line_loggers_replace_the_recipes(runs):
    result, folder = runs("my_recipes")
    assert result.returncode == 0, result.stderr[-3000:]
    (metrics,) = (folder / "cli_logs").glob("**/metrics.csv")
    assert sum(1 for row in csv.DictReader(open(metrics)) if row.get("train/loss")) == 2
    if TENSORBOARD:
        assert list((folder / "cli_logs").glob("**/events.out.tfevents.*"))
    assert not (folder / "recipe_logs").exists()


def test_command_line_callbacks_are_added_to_the_recipes(runs):
    result, folder = runs("my_recipes")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (folder / "recipe_callback_ran").read_text() == "2"  # the recipe's callback ran
    (metrics,) = (folder / "cli_logs").glob("**/metrics.csv")
    assert any(name.startswith("lr-") for name in next(csv.reader(open(metrics))))  # and LearningRateMonitor


def test_a_step_limited_progress_bar_counts_steps_not_epoch_minus_2(runs):
    result, _ = runs("my_recipes")
    assert result.returncode == 0, result.stderr[-3000:]
    shown = (result.stdout + result.stderr).replace("\r", "\n")
    assert "Epoch 0, step 2/2" in shown, shown[-2000:]
    assert "/-2" not in shown and "/-1" not in shown


# -- the same, in this process: how the command line and the recipe combine ----------------------


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "habit_recipes.py").write_text(MY_RECIPES)  # a name no other test imports
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "habit_recipes", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    return tmp_path


def _trainer(*argv: str):
    return cli.prepare(["fit", "--recipe", "habit_recipes:tiny", "--trainer.accelerator", "cpu", *argv])[2]


def test_logger_false_turns_off_the_recipes_logger(workdir):
    assert _trainer("--trainer.logger", "false").loggers == []
    assert [type(x).__name__ for x in _trainer().loggers] == ["CSVLogger"]  # the recipe's


def test_a_logger_as_json_as_in_a_lightning_cli_config(workdir):
    # CSVLogger: Lightning's one logger with no optional package behind it, so this never skips.
    given = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "csv_logs"}}
    (logger,) = _trainer("--trainer.logger", json.dumps(given)).loggers
    assert type(logger).__name__ == "CSVLogger" and logger.save_dir == "csv_logs"


@pytest.mark.parametrize("logger, package", [
    ("lightning.pytorch.loggers.CSVLogger", None),
    ("lightning.pytorch.loggers.TensorBoardLogger", "tensorboard"),
    ("lightning.pytorch.loggers.WandbLogger", "wandb"),
    ("lightning.pytorch.loggers.MLFlowLogger", "mlflow"),
])
def test_each_installed_lightning_logger_is_accepted(workdir, logger, package):
    if package == "tensorboard" and not TENSORBOARD or package not in (None, "tensorboard") and not _installed(package):
        # W&B and MLflow are not project dependencies (nor in .[dev]); a logger whose package is
        # missing cannot be built by Lightning at all, so there is nothing of ours to check.
        pytest.skip(f"{package} is not installed")
    offline = ("--trainer.logger.offline", "true") if package == "wandb" else ()  # W&B: no account, no network
    (made,) = _trainer("--trainer.logger", logger, "--trainer.logger.save_dir", str(workdir / "logs"), *offline).loggers
    assert type(made).__name__ == logger.rsplit(".", 1)[-1]


def test_callbacks_from_the_command_line_come_after_the_recipes(workdir):
    names = [type(c).__name__ for c in _trainer("--trainer.callbacks+", "LearningRateMonitor").callbacks]
    assert names.index("Marker") < names.index("LearningRateMonitor")
    assert "StepProgressBar" in names


def test_a_class_path_that_does_not_import_is_one_line(workdir, capfd):
    assert cli.main(["fit", "--recipe", "habit_recipes:tiny", "--trainer.logger", "nope.Nope"]) == 2
    err = capfd.readouterr().err
    assert err == "titan-lightning: error: trainer.logger=nope.Nope: No module named 'nope'\n"


def test_a_recipe_module_in_the_current_folder_is_found_with_no_sys_path_entry(tmp_path, monkeypatch):
    (tmp_path / "cwd_only_recipes.py").write_text(MY_RECIPES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    monkeypatch.delitem(sys.modules, "cwd_only_recipes", raising=False)
    from titan_lightning.recipe import load_recipe

    assert load_recipe("cwd_only_recipes:tiny").__name__ == "tiny"


def test_rich_progress_bar_of_a_step_limited_run_says_no_epoch_minus_2(workdir):
    pytest.importorskip("rich", reason="rich is not installed; Lightning's RichProgressBar needs it")
    from lightning.pytorch.callbacks import RichProgressBar

    trainer = _trainer("--trainer.callbacks+", "RichProgressBar")
    (bar,) = [c for c in trainer.callbacks if isinstance(c, RichProgressBar)]
    bar._trainer = trainer
    assert bar._get_train_description(0).strip() == "Epoch 0, step 0/2"


def test_prepare_starts_without_torch_and_reports_bad_input_as_the_cli_does(tmp_path):
    """The console script's ``prepare`` loads neither torch nor Lightning (titan_lightning/entry.py);
    a bad input still gets the command line's one line and exit 2."""
    (tmp_path / "a.jsonl").write_text('{"text": "one two three"}\n' * 4)
    probe = ("import sys; from titan_lightning.entry import main; "
             "code = main(['prepare', '--input', sys.argv[1], '--output', sys.argv[2], '--workers', '1', '--no-progress']); "
             "print('torch' in sys.modules, 'lightning' in sys.modules, code)")
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "a.jsonl"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.stdout.strip().splitlines()[-1] == "False False 0", done.stdout + done.stderr
    assert (tmp_path / "out" / "index.json").is_file()
    bad = subprocess.run([sys.executable, "-c", "import sys; from titan_lightning.entry import main; "
                          "sys.exit(main(['prepare', '--input', 'nope.jsonl', '--output', 'o']))"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip() == "titan-lightning: error: --input 'nope.jsonl': no such file or folder"
