"""Lightning's own ModelParallelStrategy tests, unmodified but for one import, with Lightning's own
conftest (its environment-leak, thread-leak and process-group checks), run with ``TitanStrategy`` in
place of ``ModelParallelStrategy``: the integration tests (default), or with ``--file unit`` the unit
tests (CPU; six cases check what TitanStrategy does otherwise on purpose, ``DIFFERS`` says what).

The file is not kept in this repository: it is taken from a Lightning checkout at the tag of the
installed Lightning (or ``--ref``), written under ``build/lightning_upstream/`` with the single line
``from lightning.pytorch.strategies import ModelParallelStrategy`` replaced by
``from titan_lightning.strategies import TitanStrategy as ModelParallelStrategy`` (checked: no other
line differs), and each case runs in a process of its own, as Lightning runs its standalone tests
(``PL_RUN_STANDALONE_TESTS=1``; Lightning's launcher starts the other ranks). The cases need CUDA:
2 GPUs, and 4 for ``test_setup_device_mesh`` and ``test_fsdp2_tensor_parallel``.

    git clone https://github.com/Lightning-AI/pytorch-lightning /path/to/lightning   # once
    python tests/lightning_upstream/run.py --lightning /path/to/lightning             # TitanStrategy
    python tests/lightning_upstream/run.py --lightning /path/to/lightning --control   # ModelParallelStrategy
    python tests/lightning_upstream/run.py --lightning /path/to/lightning --file unit # the unit tests

Prints one line per case and exits 1 if any failed. (On CPUs, the same cases rewritten for gloo:
tests/unit_tests/cpu/test_lightning_mps_cases.py.)
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_FILES = {"integration": "tests/tests_pytorch/strategies/test_model_parallel_integration.py",
              "unit": "tests/tests_pytorch/strategies/test_model_parallel.py"}
TEST_FILE = TEST_FILES["integration"]
# What the test files import from Lightning's test tree (tests_pytorch.helpers, its conftest).
PATHS = ["tests/tests_pytorch/__init__.py", "tests/tests_pytorch/conftest.py", "tests/tests_pytorch/helpers",
         "tests/tests_pytorch/strategies/__init__.py"]
# The unit file's cases that check what TitanStrategy does otherwise on purpose (Lightning 2.6.5: the
# other 10 of its 16 pass).
DIFFERS = {
    "test_torch_greater_equal_2_4": "the message names the class in use (TitanStrategy requires PyTorch 2.4 ...)",
    "test_save_checkpoint_storage_options": "the message names the class in use (TitanStrategy.save_checkpoint ...)",
    "test_configure_model_required": "TitanStrategy shards a module without configure_model itself (its repeated "
                                     "blocks, parallel/fsdp.py)",
    "test_set_timeout": "a module without a job gets the watchdog's timeout and the process group a 60 s later "
                        "backstop (the hung rank is named first); the test's Mock module also reads as one with a job",
    "test_save_checkpoint_path_exists": "asserts on Lightning's own shutil and _atomic_save (mocked), and a folder "
                                        "without titan_lightning's manifest is not replaced by a file",
    "test_meta_device_materialization": "calls setup() without setup_environment(), which makes the mesh "
                                        "TitanStrategy parallelizes on; in a Trainer meta-device modules are "
                                        "materialized with Lightning's warning (test_lightning_semantics.py)",
}
LIGHTNING_IMPORT = "from lightning.pytorch.strategies import ModelParallelStrategy\n"
TITAN_IMPORT = "from titan_lightning.strategies import TitanStrategy as ModelParallelStrategy\n"


def lightning_ref(repo: Path, ref: str | None) -> str:
    """``ref``, else the tag of the installed Lightning, else the newest tag of its minor version."""
    if ref:
        return ref
    import lightning

    version = lightning.__version__
    tags = subprocess.run(["git", "-C", str(repo), "tag", "--list", f"{version.rsplit('.', 1)[0]}.*"],
                          capture_output=True, text=True, check=True).stdout.split()
    if version in tags:
        return version
    older = sorted((t for t in tags if t.replace(".", "").isdigit()), key=lambda t: tuple(map(int, t.split("."))))
    if not older:
        sys.exit(f"--lightning {repo}: no tag {version} or {version.rsplit('.', 1)[0]}.*; pass --ref")
    print(f"(no tag {version} in {repo}: using {older[-1]})")
    return older[-1]


def extract(repo: Path, ref: str, dest: Path, control: bool, name: str = TEST_FILE) -> Path:
    """Lightning's test tree at ``ref`` under ``dest`` with the test file ``name``, its import swapped
    unless ``control``."""
    if dest.exists():
        subprocess.run(["rm", "-rf", str(dest)], check=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref, *PATHS, name], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    test_file = dest / name
    original = test_file.read_text()
    if original.count(LIGHTNING_IMPORT) != 1:
        sys.exit(f"{name} at {ref}: expected the line {LIGHTNING_IMPORT.strip()!r} once")
    if not control:
        swapped = original.replace(LIGHTNING_IMPORT, TITAN_IMPORT)
        changed = [(a, b) for a, b in zip(original.splitlines(), swapped.splitlines()) if a != b]
        assert len(changed) == 1 and len(original.splitlines()) == len(swapped.splitlines()), changed
        test_file.write_text(swapped)
    return test_file


# (the extracted files sit under this checkout, whose pyproject asks pytest-xdist for workers: one case
# at a time runs in one process)
ONE_PROCESS = ("-n", "0") if importlib.util.find_spec("xdist") else ()


def cases(test_file: Path, env: dict) -> list[str]:
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             *ONE_PROCESS, str(test_file)], capture_output=True, text=True, env=env,
                            cwd=test_file.parents[2])
    ids = [line.split("::", 1)[1] for line in listed.stdout.splitlines() if "::" in line]
    if not ids:
        sys.exit(f"no case collected from {test_file}:\n{listed.stdout[-3000:]}{listed.stderr[-3000:]}")
    return ids


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lightning", type=Path, required=True,
                        help="a git checkout of Lightning-AI/pytorch-lightning")
    parser.add_argument("--ref", help="the tag or commit to take the tests from (default: the installed version's)")
    parser.add_argument("--control", action="store_true", help="run them with ModelParallelStrategy itself")
    parser.add_argument("--file", choices=sorted(TEST_FILES), default="integration",
                        help="Lightning's integration tests (CUDA) or its unit tests (CPU)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per case")
    parser.add_argument("-k", dest="only", help="run the cases whose id contains this text")
    args = parser.parse_args(argv)
    ref = lightning_ref(args.lightning, args.ref)
    test_file = extract(args.lightning, ref, ROOT / "build" / "lightning_upstream", args.control, TEST_FILES[args.file])
    differs = {} if args.control or args.file != "unit" else DIFFERS
    tests_root = test_file.parents[2]  # .../tests: Lightning's conftest imports tests_pytorch from there
    standalone = {"PL_RUN_STANDALONE_TESTS": "1"} if args.file == "integration" else {}  # (else: only those)
    env = {**os.environ, **standalone,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tests_root), str(ROOT), os.environ.get("PYTHONPATH")]))}
    strategy = "ModelParallelStrategy" if args.control else "TitanStrategy"
    failed, skipped, differed = [], [], []
    selected = [c for c in cases(test_file, env) if args.only is None or args.only in c]
    for case in selected:
        begun = time.monotonic()
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-x", "-p", "no:cacheprovider",
                                   *ONE_PROCESS, f"{test_file}::{case}"], capture_output=True, text=True, env=env,
                                  cwd=tests_root, timeout=args.timeout)
            log = done.stdout + done.stderr
            summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
            outcome = ("FAILED" if done.returncode != 0 else "passed" if " passed" in summary
                       else "SKIPPED" if "skipped" in summary else "FAILED")
        except subprocess.TimeoutExpired as expired:
            outcome, log = f"TIMEOUT ({args.timeout} s)", str(expired.stdout or "") + str(expired.stderr or "")
        if outcome == "FAILED" and case in differs:
            outcome = "differs"
        print(f"{outcome:8} {time.monotonic() - begun:6.1f} s  {case}", flush=True)
        if outcome == "differs":
            differed.append(case)
            print(f"    on purpose: {differs[case]}", flush=True)
        elif outcome == "SKIPPED":
            skipped.append(case)
            print(f"    {summary}", flush=True)
        elif outcome != "passed":
            failed.append(case)
            print("    " + "\n    ".join(log.strip().splitlines()[-25:]), flush=True)
    ran = len(selected) - len(skipped)
    print(f"{strategy}, Lightning {ref}: {ran - len(failed) - len(differed)} of {len(selected)} passed"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; {len(differed)} differ on purpose" if differed else "")
          + (f"; {len(skipped)} skipped (Lightning's RunIf: CUDA GPUs)" if skipped else ""))
    return 1 if failed or skipped else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
