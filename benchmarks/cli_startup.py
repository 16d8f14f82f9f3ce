"""How long ``titan-lightning`` takes to refuse a bad flag: the console script (titan_lightning/entry.py,
which checks the flags before torch and Lightning load: titan_lightning/flags.py) next to the full
command line (``python -m titan_lightning.cli``, which imports them first, as every command did
before). Median wall and CPU seconds over ``--runs`` runs of each, the exit status and the line.

    python -m benchmarks.cli_startup --runs 5

Each run is a fresh process in an empty folder. On a shared machine the CPU time is the steadier
(the wall time counts the waits for the other processes' cores).
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

D = ["fit", "--recipe", "recipes.llama3:debugmodel"]
BAD_FLAGS = {
    "misspelt job field": [*D, "--job.training.sequence_len", "5"],
    "misspelt Trainer argument": [*D, "--trainer.max_stepz", "5"],
    "option outside the set": [*D, "--max_steps", "5"],
    "word for an integer": [*D, "--trainer.max_steps", "ten"],
    "recipe module missing": ["fit", "--recipe", "recipes.llama4:debugmodel"],
    "unknown command": ["train", "--recipe", "recipes.llama3:debugmodel"],
}
COMMANDS = {"console script (flags first)": [sys.executable, "-m", "titan_lightning.entry"],
            "full command line (imports first)": [sys.executable, "-m", "titan_lightning.cli"]}


def time_once(command: list[str], cwd: str) -> tuple[float, float, int, str]:
    """(wall s, CPU s of the child, exit status, last line of stderr) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = result.stderr.strip().splitlines()
    return wall, cpu, result.returncode, lines[-1] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each command and flag (the median is shown)")
    parser.add_argument("--cases", default=",".join(BAD_FLAGS), help="comma-separated names of BAD_FLAGS")
    options = parser.parse_args()
    cases = options.cases.split(",")
    print(f"median of {options.runs} runs; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print(f"{'bad flag':<28}{'command':<36}{'wall s':>8}{'CPU s':>8}  status, line")
    with tempfile.TemporaryDirectory() as folder:
        for case in cases:
            for name, command in COMMANDS.items():
                runs = [time_once([*command, *BAD_FLAGS[case]], folder) for _ in range(options.runs)]
                wall = statistics.median(r[0] for r in runs)
                cpu = statistics.median(r[1] for r in runs)
                _, _, status, line = runs[-1]
                print(f"{case:<28}{name:<36}{wall:>8.2f}{cpu:>8.2f}  {status}, {line[:90]}", flush=True)


if __name__ == "__main__":
    main()
