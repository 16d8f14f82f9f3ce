"""Loss compare: run a baseline and a test recipe from the same seed checkpoint, in deterministic
mode, and compare their per-step loss and grad norm.

    python scripts/loss_compare.py --baseline recipes.tests.features:llama3_debugmodel \\
        --test recipes.tests.features:llama3_fsdp2 --test-ngpu 2 --rtol 1e-5
    python scripts/loss_compare.py --baseline R --test R --assert-equal        # exact, e.g. a refactor
    python scripts/loss_compare.py --baseline R --export base.json              # keep the numbers ...
    python scripts/loss_compare.py --import base.json --test R --assert-equal   # ... compare later
    python scripts/loss_compare.py --baseline R --baseline-commit main~1 --test-commit HEAD --assert-equal

Both runs are real-PG launches (gloo on CPU, NCCL on GPU) of ``titan-lightning fit`` with
``--job.training.deterministic true``. The seed checkpoint (the baseline recipe's model as
one process initializes it) is written to OUT/seed.safetensors and loaded by both runs after
parallelization, so the comparison does not rest on each layout initializing identically.
With commits, each side runs in a git worktree of its commit (the seed checkpoint is made
by the baseline's commit). Exit status: 0 the runs agree (or nothing was asserted), 1 they
differ, 2 bad input.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Optional

from titan_lightning.testing.launch import LaunchError, launch, pythonpath_env

REPO = Path(__file__).resolve().parents[2]


# The keys of a side's numbers, as run_side returns them and --export writes them.
NUMBERS = ("recipe", "ngpu", "steps", "losses", "grad_norms")


class CompareError(Exception):
    """Bad input (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loss_compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="recipe module:function of the baseline run")
    parser.add_argument("--baseline-ngpu", type=int, default=1)
    parser.add_argument("--test", help="recipe of the tested run (default: the baseline's)")
    parser.add_argument("--test-ngpu", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="trainer.max_steps of both (default: the recipes')")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--seed-checkpoint", type=Path, help="use this seed checkpoint instead of creating one")
    parser.add_argument("--no-seed-checkpoint", action="store_true", help="each run initializes itself")
    parser.add_argument("--assert-equal", action="store_true", help="fail unless every step is bitwise equal")
    parser.add_argument("--rtol", type=float, default=None, help="fail when a relative difference exceeds this")
    parser.add_argument("--export", type=Path, help="write both runs' numbers to this JSON file")
    parser.add_argument("--import", dest="import_", type=Path, help="take the baseline's numbers from this file")
    parser.add_argument("--baseline-commit", help="run the baseline in a worktree of this git commit")
    parser.add_argument("--test-commit", help="run the test in a worktree of this git commit")
    parser.add_argument("--out", type=Path, default=None, help="logs and the seed checkpoint (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    return parser


def validate(args: argparse.Namespace) -> Optional[dict]:
    """Check every input before anything is written or launched; return the --import baseline, if any."""
    if args.import_ is None and not args.baseline:
        raise CompareError("give --baseline RECIPE (or --import FILE with a baseline's numbers)")
    if args.import_ is not None and (args.baseline_commit or args.baseline_ngpu != 1):
        raise CompareError("--import takes the baseline from the file: drop --baseline-commit/--baseline-ngpu")
    if args.import_ is not None and not args.import_.is_file():
        raise CompareError(f"--import {args.import_}: no such file")
    if args.assert_equal and args.rtol is not None:
        raise CompareError("--assert-equal (exact) and --rtol conflict; give one")
    if args.rtol is not None and not args.rtol >= 0:
        raise CompareError(f"--rtol={args.rtol} must be >= 0")
    for name in ("baseline_ngpu", "test_ngpu", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CompareError(f"--{name.replace('_', '-')}={value} must be >= 1")
    if not args.timeout > 0:
        raise CompareError(f"--timeout={args.timeout} must be > 0 (seconds per run)")
    if args.seed_checkpoint is not None and args.no_seed_checkpoint:
        raise CompareError("--seed-checkpoint and --no-seed-checkpoint conflict")
    if args.seed_checkpoint is not None and not args.seed_checkpoint.is_file():
        raise CompareError(f"--seed-checkpoint {args.seed_checkpoint}: no such file")
    if args.test is None and args.import_ is None:
        args.test = args.baseline
    if args.test is None:
        raise CompareError("give --test RECIPE to compare with the imported baseline")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise CompareError(f"--out {args.out} is a file; give a new or existing folder")
    if args.export is not None and args.export.is_dir():
        raise CompareError(f"--export {args.export} is a folder; give a JSON file path")
    for recipe in filter(None, (args.baseline, args.test)):
        if ":" not in recipe:
            raise CompareError(f"recipe {recipe!r} must look like package.module:function")
    for flag in ("baseline_commit", "test_commit"):
        _check_commit(flag, getattr(args, flag))
    if args.seed_checkpoint is not None:
        _check_safetensors(args.seed_checkpoint)
    imported = read_numbers(args.import_) if args.import_ is not None else None
    # Load the recipes that run from this checkout; a side with a commit runs that commit's recipe.
    checked = set()
    for flag, spec, commit in (("baseline", args.baseline, args.baseline_commit), ("test", args.test, args.test_commit)):
        if spec and commit is None and spec not in checked:
            _check_recipe(flag, spec)
            checked.add(spec)
    return imported


def _check_commit(flag: str, commit: Optional[str]) -> None:
    if commit is None:
        return
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                          capture_output=True, text=True)
    if done.returncode:
        raise CompareError(f"--{flag.replace('_', '-')} {commit!r} is not a commit of {REPO}; "
                           f"give a commit, branch or tag (git rev-parse --verify)")


def _check_safetensors(path: Path) -> None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt"):
            pass
    except (SafetensorError, OSError) as error:
        raise CompareError(f"--seed-checkpoint {path} is not a safetensors file ({error})") from None


def _check_recipe(flag: str, spec: str) -> None:
    """Load the recipe and call it, as the run will (a failing import or recipe is a RecipeError)."""
    from titan_lightning.recipe import RecipeError, build_run  # (start-up time: --help and --import need no torch)

    try:
        build_run(spec)
    except RecipeError as error:
        raise CompareError(f"--{flag}: {error}") from None


def read_numbers(path: Path) -> dict:
    """The baseline of a file written by --export, checked so that the comparison cannot trip on it."""
    try:
        numbers = json.loads(path.read_text())
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CompareError(f"--import {path} is not JSON ({error}); give a file written by --export") from None
    baseline = numbers.get("baseline") if isinstance(numbers, dict) else None
    if not isinstance(baseline, dict):
        raise CompareError(f"--import {path} has no 'baseline' object; give a file written by --export")
    missing = [key for key in NUMBERS if key not in baseline]
    if missing:
        raise CompareError(f"--import {path}: 'baseline' lacks {', '.join(missing)}; a file written by --export "
                           f"has {', '.join(NUMBERS)}")
    steps = baseline["steps"]
    for key in ("steps", "losses", "grad_norms"):
        values = baseline[key]
        if not (isinstance(values, list) and len(values) == len(steps) and all(isinstance(v, (int, float)) for v in values)):
            raise CompareError(f"--import {path}: baseline.{key}={values!r:.60} must be a list of numbers, "
                               f"one per entry of baseline.steps")
    return baseline


@contextmanager
def worktree(commit: Optional[str]) -> Iterator[Path]:
    """The repository at ``commit`` (a temporary git worktree), or this checkout when None."""
    if commit is None:
        yield REPO
        return
    folder = Path(tempfile.mkdtemp(prefix="loss_compare_"))
    target = folder / "repo"
    done = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(target), commit],
                          capture_output=True, text=True)
    if done.returncode:
        shutil.rmtree(folder, ignore_errors=True)
        reason = (done.stderr.strip().splitlines() or ["git worktree add failed"])[-1]
        raise CompareError(f"cannot check out commit {commit!r}: {reason}")
    try:
        yield target
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(target)], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def make_seed_checkpoint(recipe: str, path: Path, root: Path, timeout: float) -> Path:
    """Create the seed checkpoint with the code at ``root`` (a fresh process: that checkout's imports)."""
    command = [sys.executable, "-m", "titan_lightning.testing.seed_checkpoint", recipe, str(path)]
    done = subprocess.run(command, cwd=root, env={**os.environ, **pythonpath_env(root), "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"creating the seed checkpoint of {recipe} failed:\n{done.stderr[-4000:]}")
    return path


def run_side(recipe: str, ngpu: int, args: argparse.Namespace, root: Path, out: Path, seed: Optional[Path]) -> dict:
    """One run: its per-step steps, losses and grad norms (rank 0's, which all ranks share)."""
    argv = ["fit", "--recipe", recipe, "--trainer.accelerator", args.accelerator, "--trainer.devices", str(ngpu),
            "--job.training.deterministic", "true"]
    if args.steps is not None:
        argv += ["--trainer.max_steps", str(args.steps)]
    env = pythonpath_env(root)
    if args.accelerator == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(ngpu))))
    options = ["--seed-checkpoint", str(seed)] if seed is not None else []
    # Another commit's checkout runs there (fresh interpreters: its imports); this one's ranks are forked.
    result = launch(argv, ngpu, out_dir=out, timeout=args.timeout, env=env, worker_options=options,
                    cwd=None if root == REPO else root)
    rank0 = result.ranks[0]
    return {"recipe": recipe, "ngpu": ngpu, "steps": rank0["steps"], "losses": rank0["losses"],
            "grad_norms": rank0["grad_norms"]}


def compare(baseline: dict, test: dict, *, rtol: Optional[float]) -> tuple[str, Optional[str]]:
    """(a table of both runs, the first failing difference or None). ``rtol=0`` is exact equality."""
    lines = [f"{'step':>4}  {'baseline loss':>20}  {'test loss':>20}  {'rel diff':>9}  "
             f"{'baseline grad_norm':>20}  {'test grad_norm':>20}  {'rel diff':>9}"]
    failure = None
    if baseline["steps"] != test["steps"]:
        failure = f"the runs have different steps: baseline {baseline['steps']}, test {test['steps']}"
    for i, step in enumerate(test["steps"][: len(baseline["steps"])]):
        cells = [f"{step:>4}"]
        for name, singular in (("losses", "loss"), ("grad_norms", "grad_norm")):
            a, b = baseline[name][i], test[name][i]
            diff = abs(a - b) / max(abs(a), 1e-12)
            cells += [f"{a!r:>20}", f"{b!r:>20}", f"{diff:>9.2e}"]
            if rtol is not None and failure is None and (a != b if rtol == 0 else diff > rtol):
                failure = (f"step {step}: {singular} differs: baseline {a!r}, test {b!r} "
                           f"(relative {diff:.2e}{'' if rtol == 0 else f' > rtol {rtol:.0e}'})")
        lines.append("  ".join(cells))
    return "\n".join(lines), failure


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        baseline = validate(args)
        with ExitStack() as stack:
            base_root = stack.enter_context(worktree(args.baseline_commit)) if args.import_ is None else REPO
            test_root = stack.enter_context(worktree(args.test_commit))
            out = args.out or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="loss_compare_")))
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise CompareError(f"--out {out}: cannot create the folder ({error})") from None
            seed = args.seed_checkpoint
            if seed is None and not args.no_seed_checkpoint:
                seed = make_seed_checkpoint(args.baseline or args.test, out / "seed.safetensors", base_root, args.timeout)
            if baseline is None:
                baseline = run_side(args.baseline, args.baseline_ngpu, args, base_root, out / "baseline", seed)
            test = run_side(args.test, args.test_ngpu, args, test_root, out / "test", seed)
    except CompareError as error:
        message = " ".join(str(error).splitlines())  # a recipe's own message may span lines
        print(f"loss_compare: error: {message}", file=sys.stderr)
        return 2
    except LaunchError as error:
        print(f"loss_compare: a run failed: {error}", file=sys.stderr)
        return 1
    rtol = 0.0 if args.assert_equal else args.rtol
    table, failure = compare(baseline, test, rtol=rtol)
    print(f"baseline: {baseline['recipe']} on {baseline['ngpu']} rank(s)"
          f"{f' at {args.baseline_commit}' if args.baseline_commit else ''}\n"
          f"test:     {test['recipe']} on {test['ngpu']} rank(s){f' at {args.test_commit}' if args.test_commit else ''}\n"
          f"{table}")
    if args.export is not None:
        args.export.parent.mkdir(parents=True, exist_ok=True)
        args.export.write_text(json.dumps({"baseline": baseline, "test": test}, indent=1) + "\n")
    if failure is not None:
        print(f"loss_compare: FAILED: {failure}", file=sys.stderr)
        return 1
    print("loss_compare: " + ("equal" if rtol == 0 else f"within rtol {rtol:.0e}" if rtol else "compared (nothing asserted)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
