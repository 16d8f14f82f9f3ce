"""One rank of a launched run: ``python -m titan_lightning.testing.worker --out DIR [options] -- fit --recipe MOD:FN ...``.

Runs the command as ``titan-lightning`` would, recording loss and grad norm after every
optimizer step, and writes ``DIR/rank{r}.json``::

    {"rank", "world_size", "strategy", "cluster_environment", "steps", "losses", "grad_norms", "step_times", "metrics"}

Options (before ``--``): ``--golden PATH --golden-mode compare|export --golden-config NAME``
add a GoldenNumerics callback; ``--seed-checkpoint PATH`` loads a full-model seed
checkpoint into the parallelized model before the first step. ``TITAN_LIGHTNING_FAULT_IN_SAVE``
in the environment injects a fault into a checkpoint save (``titan_lightning.testing.faults``).

Or, when anything raises, ``DIR/rank{r}.error`` with the traceback (exit status 1). The
process ends with ``os._exit`` after a barrier and ``destroy_process_group``: gloo workers
otherwise abort in interpreter shutdown now and then. SIGUSR1 prints every thread's stack (and
so does a fatal signal: ``launch`` sets ``PYTHONFAULTHANDLER`` for every rank).
"""

import argparse
import faulthandler
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

# Before torch and lightning: a rank stuck even in an import prints its stack instead of dying of SIGUSR1.
faulthandler.register(signal.SIGUSR1, all_threads=True)

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from titan_lightning.cli import prepare  # noqa: E402
from titan_lightning.callbacks.golden import GoldenNumerics  # noqa: E402
from titan_lightning.recipe import execute  # noqa: E402
from titan_lightning.testing.faults import install_from_env  # noqa: E402
from titan_lightning.testing.launch import THREADS_ENV  # noqa: E402
from titan_lightning.testing.record import RecordSteps  # noqa: E402
from titan_lightning.testing.seed_checkpoint import LoadSeedCheckpoint  # noqa: E402
from titan_lightning.trainer import RUN_DIR_ENV  # noqa: E402

USAGE = (
    "usage: python -m titan_lightning.testing.worker --out DIR [--golden PATH --golden-mode compare|export "
    "--golden-config NAME] [--seed-checkpoint PATH] -- fit|validate|test --recipe MOD:FN [overrides]"
)


def main(argv: list[str]) -> None:
    options, command_argv = _parse(argv)
    out = Path(options.out)
    torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
    os.environ.setdefault(RUN_DIR_ENV, str(out / "run"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        install_from_env()
        report = run_command(command_argv, callbacks=callbacks(options))
        _write(out / f"rank{report['rank']}.json", json.dumps(report))
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        text = traceback.format_exc()
        print(text, file=sys.stderr)
        _write(out / f"rank{rank}.error", text)
        _exit(1)
    _exit(0)


def callbacks(options: argparse.Namespace) -> list[L.Callback]:
    """The callbacks the worker's options ask for."""
    extra: list[L.Callback] = []
    if options.seed_checkpoint:
        extra.append(LoadSeedCheckpoint(options.seed_checkpoint))
    if options.golden:
        extra.append(GoldenNumerics(options.golden, mode=options.golden_mode, config_name=options.golden_config))
    return extra


def run_command(argv: list[str], callbacks: Optional[list[L.Callback]] = None) -> dict[str, Any]:
    """Run one command in this process (with ``callbacks`` added) and return what the rank reports."""
    prepared = prepare(argv)
    if prepared is None:
        raise SystemExit(f"`{' '.join(argv)}` only prints; nothing to run")
    command, run, trainer = prepared
    record = RecordSteps()
    trainer.callbacks.extend([record, *(callbacks or [])])
    execute(command, run, trainer)
    environment = getattr(trainer.strategy, "cluster_environment", None)
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "cluster_environment": None if environment is None else type(environment).__name__,
        "steps": record.steps,
        "losses": record.losses,
        "grad_norms": record.grad_norms,
        "step_times": record.step_times,
        "metrics": {key: value.item() for key, value in trainer.callback_metrics.items() if value.numel() == 1},
    }


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        print(f"{USAGE}\n{message}", file=sys.stderr)
        _exit(2)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        _Parser().error(f"no '--' before the command; got: {argv}")
    split = argv.index("--")
    parser = _Parser(prog="python -m titan_lightning.testing.worker", add_help=False)
    parser.add_argument("--out", required=True)
    parser.add_argument("--golden")
    parser.add_argument("--golden-mode", choices=("compare", "export"), default="compare")
    parser.add_argument("--golden-config")
    parser.add_argument("--seed-checkpoint")
    options = parser.parse_args(argv[:split])
    if not argv[split + 1:]:
        parser.error("no command after '--'")
    return options, argv[split + 1:]


def _write(path: Path, text: str) -> None:
    # Write then rename, so a reader never sees half a file.
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def _exit(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
