"""Run integration suites outside pytest, torchtitan-style, each test in its own processes.

    python -m tests.integration_tests.run_tests OUTPUT_DIR
        [--test_suite features,models] [--execution_mode fake_pg|real_pg]
        [--test_scope all|real_pg_required] [--test_name NAME] [--ngpu N]
        [--export-numerics] [--exclude a,b] [--gpu_arch_type cuda|rocm|cpu]
        [--parallel/--no-parallel]

OUTPUT_DIR must be empty or absent; each test writes its rank logs to
OUTPUT_DIR/<suite>/<test>/. Tests are packed onto the devices largest first, each pinned
to a disjoint set (CUDA_VISIBLE_DEVICES), never more than --ngpu devices at once; on CPU
(gloo) --ngpu is the number of ranks that may run at once. A fake-PG test takes one device.

--export-numerics writes each selected entry's golden file (with its header) instead of
comparing. Regenerate the CPU goldens of the features suite:

    python -m tests.integration_tests.run_tests /tmp/goldens --gpu_arch_type cpu --ngpu 4 --export-numerics \\
        --execution_mode fake_pg && \\
    python -m tests.integration_tests.run_tests /tmp/goldens_real --gpu_arch_type cpu --ngpu 4 --export-numerics \\
        --execution_mode real_pg

Exit status: 0 all selected tests passed, 1 one failed (its last 50 log lines are printed),
2 bad input (nothing ran).
"""

import argparse
import sys
import threading
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from tests.integration_tests import HARDWARE_SUITES, SUITES, load_suite
from titan_lightning.testing.entries import EXECUTION_MODES, TestEntry, validate_fake_pg_compatibility
from titan_lightning.testing.launch import TAIL_LINES, LaunchError

USAGE_ERROR = 2


class RunnerError(Exception):
    """Bad input: reported in one line, exit status 2, before anything runs."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage + error
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


@dataclass
class Task:
    suite: str
    entry: TestEntry
    mode: str
    devices: int  # how many devices (CPU: ranks) the test holds while it runs
    skip: Optional[str] = None  # why it does not run


@dataclass
class Outcome:
    task: Task
    status: str  # passed | failed | skipped
    seconds: float = 0.0
    devices: list[int] = field(default_factory=list)
    golden: str = ""
    detail: str = ""  # failure: the error and the last log lines


# -- flags ------------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m tests.integration_tests.run_tests", description=__doc__.split("\n")[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--test_suite", default="features", help=f"comma-separated, of {', '.join(SUITES)}")
    parser.add_argument("--execution_mode", default="real_pg", choices=EXECUTION_MODES)
    parser.add_argument("--test_scope", default="all", choices=("all", "real_pg_required"))
    parser.add_argument("--test_name", default="all", help="run only this entry")
    parser.add_argument("--ngpu", type=int, default=8, help="devices (CPU: ranks) in use at once")
    parser.add_argument("--export-numerics", dest="export_numerics", action="store_true",
                        help="write golden files instead of comparing")
    parser.add_argument("--exclude", default="", help="comma-separated entry names to leave out")
    parser.add_argument("--gpu_arch_type", default=None, choices=("cuda", "rocm", "cpu"),
                        help="cpu runs real PG on gloo; default: cuda when a GPU is visible, else cpu")
    parser.add_argument("--parallel", action=argparse.BooleanOptionalAction, default=True,
                        help="run several tests at once when devices allow (default)")
    return parser


def validate(args: argparse.Namespace, gpu_count: Optional[Callable[[], int]] = None) -> list[Task]:
    """Check the flags against each other and the suites; return the tasks, skipped ones included."""
    if args.ngpu < 1:
        raise RunnerError(f"--ngpu={args.ngpu} must be >= 1")
    suites = _names(args.test_suite)
    unknown = [s for s in suites if s not in SUITES]
    if not suites or unknown:
        raise RunnerError(f"--test_suite={args.test_suite!r}: unknown suite {unknown or ['']}; expected of {', '.join(SUITES)}")
    if args.test_scope == "real_pg_required" and args.execution_mode != "real_pg":
        raise RunnerError(f"--test_scope real_pg_required needs --execution_mode real_pg, got {args.execution_mode}")
    hardware = [s for s in suites if s in HARDWARE_SUITES]
    if hardware and args.execution_mode == "fake_pg":
        raise RunnerError(f"--test_suite {','.join(hardware)} is hardware-specific and runs real PG only; "
                          f"use --execution_mode real_pg")
    if args.gpu_arch_type is None:
        args.gpu_arch_type = "cuda" if (gpu_count or _gpu_count)() > 0 else "cpu"
    elif args.gpu_arch_type != "cpu" and (gpu_count or _gpu_count)() == 0:
        raise RunnerError(f"--gpu_arch_type {args.gpu_arch_type} but no GPU is visible; use --gpu_arch_type cpu")
    if hardware and args.gpu_arch_type == "cpu":
        raise RunnerError(f"--test_suite {','.join(hardware)} needs GPUs; --gpu_arch_type cpu cannot run it")
    out = args.output_dir
    if out.exists() and not out.is_dir():
        raise RunnerError(f"OUTPUT_DIR {out} is a file; give a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise RunnerError(f"OUTPUT_DIR {out} is not empty; give a new or empty folder")

    entries = [(suite, entry) for suite in suites for entry in load_suite(suite)]
    names = {entry.name for _, entry in entries}
    excluded = _names(args.exclude)
    missing = [name for name in excluded if name not in names]
    if missing:
        raise RunnerError(f"--exclude names no entry of {','.join(suites)}: {', '.join(missing)}")
    if args.test_name != "all":
        if args.test_name not in names:
            raise RunnerError(f"--test_name {args.test_name!r} is no entry of {','.join(suites)}; "
                              f"entries: {', '.join(sorted(names))}")
        if args.test_name in excluded:
            raise RunnerError(f"--test_name {args.test_name} is also in --exclude")

    tasks = []
    for suite, entry in entries:
        if args.test_name not in ("all", entry.name) or entry.name in excluded:
            continue
        if args.test_scope == "real_pg_required" and not entry.use_real_pg:
            continue
        task = Task(suite, entry, args.execution_mode, 1 if args.execution_mode == "fake_pg" else entry.ngpu)
        task.skip = _skip_reason(task, args)
        if task.skip is None:
            _check_entry(task, args)
        tasks.append(task)
    if not tasks:
        raise RunnerError("the flags select no test")
    return tasks


def _skip_reason(task: Task, args: argparse.Namespace) -> Optional[str]:
    entry = task.entry
    if entry.disabled:
        return "disabled"
    if task.mode == "fake_pg" and entry.use_real_pg:
        return "needs real PG"
    if args.gpu_arch_type == "rocm" and entry.skip_rocm:
        return "skip_rocm"
    if task.devices > args.ngpu:
        return f"needs {task.devices} devices, --ngpu {args.ngpu}"
    return None


def _check_entry(task: Task, args: argparse.Namespace) -> None:
    from titan_lightning.testing.integration import check_golden

    entry, where = task.entry, f"{task.suite}:{task.entry.name}"
    try:
        if task.mode == "fake_pg":
            validate_fake_pg_compatibility(entry)
        if not args.export_numerics:
            check_golden(entry, task.mode, _hardware(args))
    except (ValueError, OSError) as error:  # a recipe (RecipeError) or a golden file the entry names
        raise RunnerError(f"{where}: {error}") from None


def _hardware(args: argparse.Namespace) -> str:
    from titan_lightning.callbacks.golden import hardware_class

    return hardware_class("cpu" if args.gpu_arch_type == "cpu" else "cuda")


def _create(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RunnerError(f"OUTPUT_DIR {folder}: cannot create the folder ({error})") from None


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# -- scheduling ---------------------------------------------------------------------------


def schedule(
    tasks: Sequence[Task], ngpu: int, execute: Callable[[Task, list[int]], Outcome], *, parallel: bool = True
) -> list[Outcome]:
    """Run ``tasks`` on a pool of ``ngpu`` device ids, largest first, each on a disjoint set of ids.

    A task starts as soon as enough ids are free (the largest that fits goes first);
    ``parallel=False`` runs one at a time. Outcomes come back in start order.
    """
    pending = sorted(tasks, key=lambda task: -task.devices)  # stable: suite order among equals
    if any(task.devices > ngpu for task in pending):
        raise ValueError(f"a task needs more than the {ngpu} devices of the pool")
    free = list(range(ngpu))
    running: dict[Future, list[int]] = {}
    started: list[Future] = []
    with ThreadPoolExecutor(max_workers=ngpu if parallel else 1) as pool:
        while pending or running:
            while pending and (parallel or not running):
                task = next((t for t in pending if t.devices <= len(free)), None)
                if task is None:
                    break
                pending.remove(task)
                ids, free[:] = free[:task.devices], free[task.devices:]
                future = pool.submit(execute, task, ids)
                running[future] = ids
                started.append(future)
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                free.extend(running.pop(future))
                free.sort()
    return [future.result() for future in started]


# -- running one test ---------------------------------------------------------------------

_print_lock = threading.Lock()


def _say(text: str) -> None:
    with _print_lock:
        print(text, flush=True)


def make_executor(args: argparse.Namespace) -> Callable[[Task, list[int]], Outcome]:
    from titan_lightning.testing.integration import ACCELERATORS, run_entry

    accelerator = ACCELERATORS[args.gpu_arch_type]

    def execute(task: Task, ids: list[int]) -> Outcome:
        where = args.output_dir / task.suite / task.entry.name
        env = None
        if accelerator != "cpu":
            visible = ",".join(str(i) for i in ids)
            env = {"CUDA_VISIBLE_DEVICES": visible, "HIP_VISIBLE_DEVICES": visible}
        _say(f"[start] {task.suite}:{task.entry.name} ({task.mode}, {task.devices} device(s) {ids})")
        start = time.monotonic()
        outcome = Outcome(task, "passed", devices=ids)
        try:
            result = run_entry(task.entry, task.mode, where, accelerator=accelerator,
                               export=args.export_numerics, env=env)
            outcome.golden = result.golden_status if result.golden is None else f"{result.golden_status} {result.golden}"
        except LaunchError as error:
            outcome.status, outcome.detail = "failed", _tails(error)
        except Exception:  # a bad recipe fails its test, not the run
            outcome.status, outcome.detail = "failed", "\n".join(traceback.format_exc().splitlines()[-TAIL_LINES:])
        outcome.seconds = time.monotonic() - start
        _say(f"[{outcome.status}] {task.suite}:{task.entry.name} in {outcome.seconds:.1f} s")
        return outcome

    return execute


def _tails(error: LaunchError) -> str:
    result = error.result
    failed = [r for r, code in enumerate(result.returncodes) if code not in (0, None)] or None
    first_line = str(error).splitlines()[0]
    return f"{first_line}\n{result.log_tails(failed, TAIL_LINES)}"


# -- report -------------------------------------------------------------------------------


def summary(outcomes: Sequence[Outcome]) -> str:
    """A fixed-width table, one row per test, and the counts."""
    header = ("suite", "test", "mode", "ngpu", "devices", "status", "seconds", "golden")
    rows = [header]
    for o in outcomes:
        status = o.status if o.task.skip is None else f"skipped ({o.task.skip})"
        devices = ",".join(map(str, o.devices)) or "-"
        rows.append((o.task.suite, o.task.entry.name, o.task.mode, str(o.task.entry.ngpu), devices, status,
                     f"{o.seconds:.1f}", o.golden or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    counts = {status: sum(o.status == status for o in outcomes) for status in ("passed", "failed", "skipped")}
    lines.append(", ".join(f"{n} {status}" for status, n in counts.items()))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse exits 2 on unknown or malformed flags
    try:
        tasks = validate(args)
        _create(args.output_dir)  # only now: a refused run leaves nothing behind
    except RunnerError as error:
        message = " ".join(str(error).splitlines())  # a recipe's own message may span lines
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return USAGE_ERROR
    runnable = [task for task in tasks if task.skip is None]
    skipped = [Outcome(task, "skipped") for task in tasks if task.skip is not None]
    _say(f"{len(runnable)} test(s) to run, {len(skipped)} skipped; {args.execution_mode} on {args.gpu_arch_type}, "
         f"--ngpu {args.ngpu}, {'parallel' if args.parallel else 'one at a time'}; logs in {args.output_dir}")
    outcomes = schedule(runnable, args.ngpu, make_executor(args), parallel=args.parallel) + skipped
    for outcome in outcomes:
        if outcome.status == "failed":
            print(f"\n===== FAILED {outcome.task.suite}:{outcome.task.entry.name} ({outcome.task.mode}) =====\n"
                  f"{outcome.detail}")
    print("\n" + summary(outcomes))
    return 1 if any(o.status == "failed" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
