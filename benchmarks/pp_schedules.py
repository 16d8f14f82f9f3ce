"""Time per training step of pipeline schedules on 4 CPU ranks (gloo), interleaved runs.

    python benchmarks/pp_schedules.py [--steps 8] [--repeats 2] [--layers 8] [--microbatches 8]
        [--schedules 1F1B,Interleaved1F1B] [--out /tmp/pp_schedules]

Each run is `recipes.llama3:pp2` (the Llama 3 debug model, 8 sequences of 256 tokens per step)
with pp=4, --layers layers and --microbatches microbatches; looped schedules hold 2 stages
per rank. The schedules alternate (A B A B ...) so machine drift cancels. Printed: the
median step time over steps 3.. of every run of a schedule, its spread (min-max), and the
loss of the last step (all schedules train the same numbers).
On 2 cores, 4 ranks share the CPU: the bubble shows as idle ranks, not as lost throughput.
"""

import argparse
import statistics
from pathlib import Path

from titan_lightning.testing.launch import launch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default="1F1B,Interleaved1F1B")
    parser.add_argument("--out", type=Path, default=Path("/tmp/pp_schedules"))
    args = parser.parse_args()
    schedules = args.schedules.split(",")
    times: dict[str, list[float]] = {s: [] for s in schedules}
    last_loss: dict[str, float] = {}
    for repeat in range(args.repeats):
        for schedule in schedules:
            argv = [
                "fit", "--recipe", "recipes.llama3:pp2", "--trainer.accelerator", "cpu", "--trainer.devices", "4",
                "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0",
                "--trainer.enable_checkpointing", "false",
                "--job.model.n_layers", str(args.layers), "--job.parallelism.pp", "4",
                "--job.parallelism.pp_schedule", schedule, "--job.parallelism.pp_microbatches", str(args.microbatches),
            ]
            report = launch(argv, 4, out_dir=args.out / f"{schedule}_{repeat}", timeout=1200).ranks[0]
            times[schedule] += report["step_times"][2:]
            last_loss[schedule] = report["losses"][-1]
            print(f"{schedule} run {repeat}: steps {[round(t, 2) for t in report['step_times']]}", flush=True)
    print(f"\n| schedule (pp=4, {args.layers} layers, {args.microbatches} microbatches) | median s/step | min-max | "
          f"last loss |")
    print("|---|---|---|---|")
    for schedule in schedules:
        t = times[schedule]
        print(f"| {schedule} | {statistics.median(t):.2f} | {min(t):.2f}-{max(t):.2f} | {last_loss[schedule]:.6f} |")


if __name__ == "__main__":
    main()
