"""Per-step parity of every parallel layout with the single-process run (CPU, gloo).

    python benchmarks/parity.py [--steps 5] [--out /tmp/parity] [--only cp]

Prints one row per layout: world size, max relative loss / grad-norm difference over
the steps, and the wall time of the launch (process start-up included).
"""

import argparse
import time
from pathlib import Path

from titan_lightning.testing.launch import launch, run_single

LAYOUTS = [
    ("llama3_fsdp2", 2), ("llama3_ddp2", 2), ("llama3_tp2", 2), ("llama3_tp2_no_sp", 2),
    ("llama3_fsdp4", 4), ("llama3_ddp4", 4), ("llama3_hsdp2x2", 4), ("llama3_tp4", 4),
    ("llama3_tp4_no_sp", 4), ("llama3_fsdp2_tp2", 4), ("llama3_fsdp2_tp2_bf16", 4), ("llama3_hsdp2x2_tp2", 8),
]
CP_LAYOUTS = [
    ("llama3_cp2", 2), ("llama3_cp2_ring", 2), ("llama3_cp2_ulysses", 2), ("llama3_cp4", 4), ("llama3_cp4_ring", 4),
    ("llama3_cp4_ulysses", 4), ("llama3_fsdp2_cp2", 4), ("llama3_hsdp2_cp2", 4), ("llama3_fsdp2_tp2_cp2", 8),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("/tmp/parity"))
    parser.add_argument("--only", choices=("all", "cp"), default="all", help="cp: the context-parallel layouts only")
    args = parser.parse_args()
    fit = ["fit", "--trainer.accelerator", "cpu", "--trainer.max_steps", str(args.steps)]
    ref = run_single([*fit, "--recipe", "recipes.tests.features:llama3_debugmodel", "--trainer.devices", "1"],
                     out_dir=args.out / "reference", timeout=600).ranks[0]
    print(f"| layout | world | max rel. loss diff | max rel. grad-norm diff | wall s |")
    print(f"|---|---|---|---|---|")
    for recipe, world in (CP_LAYOUTS if args.only == "cp" else LAYOUTS + CP_LAYOUTS):
        start = time.perf_counter()
        got = launch([*fit, "--recipe", f"recipes.tests.features:{recipe}", "--trainer.devices", str(world)], world,
                     out_dir=args.out / recipe, timeout=900).ranks[0]
        wall = time.perf_counter() - start
        loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        norm = max(abs(a - b) / abs(b) for a, b in zip(got["grad_norms"], ref["grad_norms"]))
        print(f"| {recipe.removeprefix('llama3_')} | {world} | {loss:.1e} | {norm:.1e} | {wall:.0f} |", flush=True)


if __name__ == "__main__":
    main()
