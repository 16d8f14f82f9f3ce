"""Time forward + backward of each context-parallel attention backend on CPU gloo.

    python benchmarks/cp_attention.py --cp 4 --seq 8192
    python benchmarks/cp_attention.py --cp 4 --seq 8192 --model   # whole training steps

One process per CP rank (titan_lightning.testing.spawn), one torch thread each, fp32,
Llama 3 debugmodel heads (16 x 16). Prints the median over --repeats of the slowest rank.
With ``--model``: training steps of the debug model (recipes.llama3:cp4 with the backend
swapped in, one sequence of --seq tokens per step) through the normal CLI path; the time
of the last of --repeats + 1 steps (the first is warm-up), from its logged tokens/s.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def time_backend(rank: int, world_size: int, *, backend: str, seq: int, heads: int, kv_heads: int, head_dim: int,
                 repeats: int) -> list[float]:
    import torch
    import torch.distributed as dist

    from titan_lightning.parallel.context import ContextParallel, context_parallel_attention

    cp = ContextParallel(group=dist.group.WORLD, rank=rank, size=world_size, load_balancer="headtail")
    g = torch.Generator().manual_seed(rank)
    local = seq // world_size
    q = torch.randn(1, local, heads, head_dim, generator=g, requires_grad=True)
    k = torch.randn(1, local, kv_heads, head_dim, generator=g, requires_grad=True)
    v = torch.randn(1, local, kv_heads, head_dim, generator=g, requires_grad=True)
    times = []
    for _ in range(repeats + 1):  # the first is warm-up
        dist.barrier()
        start = time.perf_counter()
        context_parallel_attention(q, k, v, cp, backend).sum().backward()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    from titan_lightning.testing.spawn import run_function

    parser = argparse.ArgumentParser()
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", action="store_true", help="time whole training steps of the debug model")
    args = parser.parse_args()
    if args.model:
        return time_model_steps(args)
    print(f"cp={args.cp} seq={args.seq} heads={args.heads}/{args.kv_heads}x{args.head_dim}, fp32, CPU gloo, "
          f"1 thread per rank; forward+backward seconds (median of {args.repeats}, slowest rank)")
    for backend in ("allgather", "ring", "ulysses"):
        with tempfile.TemporaryDirectory() as out:
            ranks = run_function("benchmarks.cp_attention:time_backend", args.cp, out_dir=Path(out), timeout=900,
                                 backend=backend, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads,
                                 head_dim=args.head_dim, repeats=args.repeats)
        slowest = [max(step) for step in zip(*ranks)]
        print(f"{backend:>10}: {statistics.median(slowest):.3f} s")


def time_model_steps(args) -> None:
    from titan_lightning.testing.launch import launch

    print(f"debugmodel, cp={args.cp}, one {args.seq}-token sequence per step, fp32, CPU gloo, 1 thread per rank; "
          f"seconds per training step (step {args.repeats + 1})")
    for backend in ("allgather", "ring", "ulysses"):
        argv = ["fit", "--recipe", "recipes.llama3:cp4", "--job.parallelism.cp", str(args.cp),
                "--job.model.attention", backend, "--job.training.seq_len", str(args.seq), "--job.model.max_seq_len", str(args.seq),
                "--job.training.tokens_per_microbatch_per_dp_rank", str(args.seq),
                "--trainer.max_steps", str(args.repeats + 1), "--trainer.limit_val_batches", "0",
                "--trainer.num_sanity_val_steps", "0", "--trainer.enable_checkpointing", "false",
                "--trainer.accelerator", "cpu", "--trainer.devices", str(args.cp)]
        with tempfile.TemporaryDirectory() as out:
            result = launch(argv, args.cp, out_dir=Path(out), timeout=1800)
        tokens_per_s = result.ranks[0]["metrics"]["train/tokens_per_s"]
        print(f"{backend:>10}: {args.seq / tokens_per_s:.2f} s/step  (loss {result.ranks[0]['losses'][-1]:.4f})")


if __name__ == "__main__":
    main()
