"""Run one integration entry in one execution mode, comparing or exporting its golden numerics.

Shared by the pytest suites (``tests/integration_tests/test_*.py``) and the runner
(``python -m tests.integration_tests.run_tests``):

- ``fake_pg``: one process simulates the entry's ``ngpu`` ranks (``FakePGStrategy``);
- ``real_pg``: ``ngpu`` processes with real collectives (gloo on CPU, NCCL on GPU).

Golden files live under ``tests/assets/losses`` at the entry's ``golden_numerics_path``,
one per execution mode and hardware class (the GPU's name such as ``h200``; on CPU one folder per
vendor, ``cpu_amd`` / ``cpu_intel``): numbers compare exactly only on the hardware class (and, where
a CPU file names it, the CPU model) that wrote them.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from titan_lightning.callbacks.golden import check_header, comparable, hardware_class, read_golden
from titan_lightning.data.tokenizer import ASSETS_DIR
from titan_lightning.parallel.mesh import ParallelDims
from titan_lightning.testing.entries import EXECUTION_MODES, TestEntry, validate_fake_pg_compatibility
from titan_lightning.testing.launch import launch
from titan_lightning.trainer import RUN_DIR_ENV

GOLDEN_ROOT = ASSETS_DIR / "losses"
ACCELERATORS = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu"}  # --gpu_arch_type -> Lightning accelerator


def entry_parallelism(entry: TestEntry) -> str:
    """The ``# parallelism:`` line a golden file of ``entry`` must carry, from its recipe's degrees."""
    job = entry.runs()[-1].job
    if job is None:
        return "single device"
    return ParallelDims.from_config(job.parallelism, entry.ngpu).describe()


def check_golden(entry: TestEntry, mode: str, hardware: str, root: Path = GOLDEN_ROOT) -> Optional[Path]:
    """The entry's golden file for ``mode`` and ``hardware`` if it can be compared, after checking its header.

    None when the entry has no golden, the file for this hardware class is not there yet,
    or it was recorded with another torch release or (CPU) CPU vendor: exact numbers hold within one.
    Raises ValueError when the file describes another world size or layout than the entry.
    """
    path = entry.golden_path(mode, root, hardware)
    if path is None or not path.exists():
        return None
    golden = read_golden(path)
    check_header(golden, ngpu=entry.ngpu, parallelism=entry_parallelism(entry), hardware=hardware)
    if comparable(golden, hardware) is not None:
        return None
    return path


def command_argv(spec: str, entry: TestEntry, mode: str, accelerator: str) -> list[str]:
    """The ``titan-lightning`` command line of one recipe of ``entry`` in ``mode``."""
    if mode not in EXECUTION_MODES:
        raise ValueError(f"execution_mode={mode!r} is not one of {', '.join(EXECUTION_MODES)}")
    argv = ["fit", "--recipe", spec, "--trainer.accelerator", accelerator]
    if mode == "fake_pg":
        return argv + ["--trainer.devices", "1", "--trainer.strategy", "FakePGStrategy",
                       "--trainer.strategy.world_size", str(entry.ngpu)]
    return argv + ["--trainer.devices", str(entry.ngpu)]


@dataclass
class EntryResult:
    """What one entry run produced: each rank's report of its last recipe and what happened to the golden."""

    ranks: list[dict]
    golden: Optional[Path] = None
    # "compared", "exported", "none" (the entry has no golden), "missing" (none for this hardware
    # yet) or "not_comparable" (recorded with another torch release, CPU model, or only on another
    # CPU vendor: this one's folder has no file yet).
    golden_status: str = "none"
    logs: list[Path] = field(default_factory=list)


def run_entry(
    entry: TestEntry,
    mode: str,
    out_dir: Path,
    *,
    accelerator: str = "cpu",
    export: bool = False,
    golden_root: Path = GOLDEN_ROOT,
    in_process: bool = False,
    env: Optional[dict] = None,
    golden_out: Optional[Path] = None,
) -> EntryResult:
    """Run every recipe of ``entry`` in order; compare with (or export, ``export=True``) its golden.

    ``in_process`` runs fake PG in this process (pytest; it cannot hang: no data moves).
    Real PG always launches one process per rank with the entry's timeout. ``golden_out``
    exports to another path than the entry's (to check that two exports are identical).
    Raises on failure: ``LaunchFailed``/``LaunchTimeout`` carry the rank logs.
    """
    if mode == "fake_pg":
        validate_fake_pg_compatibility(entry)
        if entry.use_real_pg:  # validate_fake_pg_compatibility lets marked entries through
            raise ValueError(f"entry {entry.name!r} is marked use_real_pg=True and cannot run under fake PG")
    out_dir = Path(out_dir)
    hardware = hardware_class("cpu" if accelerator == "cpu" else "cuda")
    result = EntryResult(ranks=[])
    golden_options: list[str] = []
    path = entry.golden_path(mode, golden_root, hardware)
    if path is not None:
        if export:
            result.golden, result.golden_status = golden_out or path, "exported"
            golden_options = ["--golden", str(result.golden), "--golden-mode", "export"]
        elif check_golden(entry, mode, hardware, golden_root) is not None:
            result.golden, result.golden_status = path, "compared"
            golden_options = ["--golden", str(path), "--golden-mode", "compare"]
        else:
            elsewhere = path.exists() or (hardware == "cpu" and entry.other_cpu_goldens(mode, golden_root))
            result.golden, result.golden_status = path, "not_comparable" if elsewhere else "missing"
        if golden_options:
            golden_options += ["--golden-config", entry.name]
    before = _rows(path) if export and golden_out is None and hardware == "cpu" else None
    world_size = 1 if mode == "fake_pg" else entry.ngpu
    for index, spec in enumerate(entry.recipes):
        where = out_dir / f"{index}_{spec.rpartition(':')[2]}" if len(entry.recipes) > 1 else out_dir
        argv = command_argv(spec, entry, mode, accelerator)
        if in_process and mode == "fake_pg":
            result.ranks = [_run_in_process(argv, where, golden_options)]
        else:
            launched = launch(argv, world_size, out_dir=where, timeout=entry.timeout, env=env,
                              worker_options=golden_options)
            result.ranks = launched.ranks
            result.logs += [where / f"rank{rank}.log" for rank in range(world_size)]
    if before is not None and _rows(path) != before:
        # The numbers changed (re-exported after a change): the other CPU vendors' files of this
        # entry are stale now; without them those hosts check run-to-run stability until one of
        # them exports its own again (test_goldens.py), instead of failing on the old numbers.
        for stale in entry.other_cpu_goldens(mode, golden_root):
            stale.unlink()
            print(f"{entry.name} ({mode}): the numbers changed; removed {stale} (recorded on another CPU vendor: "
                  f"export it again on such a CPU)")
    return result


def _rows(path: Optional[Path]) -> Optional[list[str]]:
    """A golden file's step lines (no header), None when there is no such file."""
    if path is None or not path.is_file():
        return None
    return [line for line in path.read_text().splitlines() if not line.startswith("#")]


def _run_in_process(argv: list[str], out_dir: Path, golden_options: list[str]) -> dict:
    import torch.distributed as dist

    from titan_lightning.testing import worker  # (its import registers a SIGUSR1 handler: only in-process runs take it)

    options, _ = worker._parse(["--out", str(out_dir), *golden_options, "--", *argv])
    out_dir.mkdir(parents=True, exist_ok=True)
    saved = os.environ.get(RUN_DIR_ENV)
    os.environ[RUN_DIR_ENV] = str(out_dir / "run")
    try:
        return worker.run_command(argv, callbacks=worker.callbacks(options))
    finally:
        if saved is None:
            os.environ.pop(RUN_DIR_ENV, None)
        else:
            os.environ[RUN_DIR_ENV] = saved
        if dist.is_initialized():  # a run that failed midway leaves its group behind
            dist.destroy_process_group()
