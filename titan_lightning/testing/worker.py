"""One rank of a launched run: ``python -m titan_lightning.testing.worker --out DIR -- fit --recipe MOD:FN ...``.

Runs the command as ``titan-lightning`` would, recording loss and grad norm after every
optimizer step, and writes ``DIR/rank{r}.json``::

    {"rank", "world_size", "strategy", "cluster_environment", "steps", "losses", "grad_norms", "metrics"}

or, when anything raises, ``DIR/rank{r}.error`` with the traceback (exit status 1). The
process ends with ``os._exit`` after a barrier and ``destroy_process_group``: gloo workers
otherwise abort in interpreter shutdown now and then. SIGUSR1 prints every thread's stack.
"""

import faulthandler
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

# Before torch and lightning: a rank stuck even in an import prints its stack instead of dying of SIGUSR1.
faulthandler.register(signal.SIGUSR1, all_threads=True)

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from titan_lightning.cli import prepare  # noqa: E402
from titan_lightning.recipe import RUN_DIR_ENV  # noqa: E402
from titan_lightning.testing.launch import THREADS_ENV  # noqa: E402
from titan_lightning.testing.record import RecordSteps  # noqa: E402

USAGE = "usage: python -m titan_lightning.testing.worker --out DIR -- fit|validate|test --recipe MOD:FN [overrides]"


def main(argv: list[str]) -> None:
    out, command_argv = _parse(argv)
    torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
    os.environ.setdefault(RUN_DIR_ENV, str(out / "run"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        report = run_command(command_argv)
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


def run_command(argv: list[str]) -> dict[str, Any]:
    """Run one command in this process and return what the rank reports."""
    prepared = prepare(argv)
    if prepared is None:
        raise SystemExit(f"`{' '.join(argv)}` only prints; nothing to run")
    command, run, trainer = prepared
    record = RecordSteps()
    trainer.callbacks.append(record)
    getattr(trainer, command)(run.module, datamodule=run.datamodule)
    environment = getattr(trainer.strategy, "cluster_environment", None)
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "cluster_environment": None if environment is None else type(environment).__name__,
        "steps": record.steps,
        "losses": record.losses,
        "grad_norms": record.grad_norms,
        "metrics": {key: value.item() for key, value in trainer.callback_metrics.items() if value.numel() == 1},
    }


def _parse(argv: list[str]) -> tuple[Path, list[str]]:
    if len(argv) < 4 or argv[0] != "--out" or argv[2] != "--":
        print(f"{USAGE}\ngot: {argv}", file=sys.stderr)
        _exit(2)
    return Path(argv[1]), argv[3:]


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
