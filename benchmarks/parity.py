"""Per-step parity of every parallel layout with the single-process run (CPU, gloo).

    python benchmarks/parity.py [--steps 5] [--out /tmp/parity] [--only cp|moe|pp]

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
PP_LAYOUTS = [
    ("llama3_pp2", 2), ("llama3_pp2_gpipe", 2), ("llama3_pp2_interleaved", 2), ("llama3_pp2_looped_bfs", 2),
    ("llama3_pp2_zero_bubble", 2), ("llama3_pp2_zbv", 2), ("llama3_pp2_csv", 2), ("llama3_pp2_fsdp2", 4),
    ("llama3_pp2_tp2", 4), ("llama3_pp2_fsdp2_tp2", 8),
]
PP_MOE_LAYOUTS = [("qwen3_moe_pp2_fsdp2_ep2", 4, "qwen3_moe_debugmodel"), ("deepseek_v3_pp2_ep2", 4, "deepseek_v3_debugmodel")]

# The one-process run of a layout that is not the debug model's (the bf16 layout runs on a smaller shape).
SEEDS = {"llama3_fsdp2_tp2_bf16": "llama3_small"}

# (recipe in recipes.tests.models, world size, its one-process run)
MOE_LAYOUTS = [
    ("qwen3_moe_fsdp2_ep2", 2, "qwen3_moe_debugmodel"), ("qwen3_moe_tp2", 2, "qwen3_moe_debugmodel"),
    ("qwen3_moe_fsdp2_tp2_cp2_ep8", 8, "qwen3_moe_debugmodel"),
    ("deepseek_v3_fsdp2_ep2", 2, "deepseek_v3_debugmodel"), ("deepseek_v3_tp2_ep2", 2, "deepseek_v3_debugmodel"),
    ("deepseek_v3_fsdp4_ep4", 4, "deepseek_v3_debugmodel"), ("deepseek_v3_fsdp4_ep2", 4, "deepseek_v3_debugmodel"),
    ("deepseek_v3_hsdp2_fsdp2_ep2", 4, "deepseek_v3_debugmodel"), ("deepseek_v3_fsdp2_tp2", 4, "deepseek_v3_debugmodel"),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("/tmp/parity"))
    parser.add_argument("--only", choices=("all", "cp", "moe", "pp"), default="all",
                        help="cp: the context-parallel layouts only; moe: the MoE / expert-parallel ones; "
                             "pp: the pipeline-parallel ones")
    args = parser.parse_args()
    fit = ["fit", "--trainer.accelerator", "cpu", "--trainer.max_steps", str(args.steps)]
    dense = [(f"recipes.tests.features:{r}", w, f"recipes.tests.features:{SEEDS.get(r, 'llama3_debugmodel')}")
             for r, w in {"all": LAYOUTS + CP_LAYOUTS + PP_LAYOUTS, "cp": CP_LAYOUTS, "moe": [],
                          "pp": PP_LAYOUTS}[args.only]]
    moe_layouts = {"all": MOE_LAYOUTS + PP_MOE_LAYOUTS, "moe": MOE_LAYOUTS, "pp": PP_MOE_LAYOUTS, "cp": []}[args.only]
    moe = [(f"recipes.tests.models:{r}", w, f"recipes.tests.models:{s}") for r, w, s in moe_layouts]
    references = {}
    print(f"| layout | world | max rel. loss diff | max rel. grad-norm diff | wall s |")
    print(f"|---|---|---|---|---|")
    for recipe, world, seed in dense + moe:
        if seed not in references:
            references[seed] = run_single([*fit, "--recipe", seed, "--trainer.devices", "1"],
                                          out_dir=args.out / seed.replace(":", "_"), timeout=600).ranks[0]
        ref = references[seed]
        start = time.perf_counter()
        got = launch([*fit, "--recipe", recipe, "--trainer.devices", str(world)], world,
                     out_dir=args.out / recipe.replace(":", "_"), timeout=900).ranks[0]
        wall = time.perf_counter() - start
        loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        norm = max(abs(a - b) / abs(b) for a, b in zip(got["grad_norms"], ref["grad_norms"]))
        print(f"| {recipe.split(':')[1].removeprefix('llama3_')} | {world} | {loss:.1e} | {norm:.1e} | {wall:.0f} |", flush=True)


if __name__ == "__main__":
    main()
