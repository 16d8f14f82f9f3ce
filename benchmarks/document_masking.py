"""How much attention document masking skips on the shipped corpus, and its cost on one GPU.

    python -m benchmarks.document_masking --batches 64          # the skipped-tile share (CPU, ~1 min)
    python -m benchmarks.document_masking --batches 64 --throughput   # + tokens/s, MFU (one GPU, ~10 min)

The share: the windows of Llama 3 1B's run at seq 8192 (the packed documents of the shipped
corpus), each window's FlexAttention block mask (128 x 128 tiles), and the share of the causal
tiles it leaves out (``skipped_block_share``): the work block-causal attention saves over causal.
``--throughput`` then runs benchmarks/throughput.py's titan contender on sdpa-causal
(``llama3_1b``), flex-causal, flex-block_causal and varlen-block_causal, one after the other.
"""

import argparse
import statistics
import subprocess
import sys


def skipped_share(batches: int, seq_len: int = 8192) -> dict:
    import torch

    from benchmarks.throughput import WORKLOADS, resolve_run
    from titan_lightning.models.common.masking import flex_block_mask, skipped_block_share

    run = resolve_run(WORKLOADS["llama3_1b"], "cpu", 10)
    dm = run.datamodule
    dm.setup("fit")
    shares, documents = [], []
    for i, batch in enumerate(dm.train_dataloader()):
        if i == batches:
            break
        positions = batch["position_ids"]
        B, S = positions.shape
        shares.append(skipped_block_share(flex_block_mask(positions, B, S, "cpu")))
        starts = torch.cat([torch.nonzero(positions.flatten() == 0).flatten(), torch.tensor([B * S])])
        documents.extend(starts.diff().tolist())
    return {"windows": len(shares), "seq_len": seq_len, "skipped_share_mean": statistics.mean(shares),
            "skipped_share_min": min(shares), "skipped_share_max": max(shares),
            "documents_per_window": len(documents) / max(len(shares), 1),
            "document_length_median": statistics.median(documents)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.document_masking", description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=64, help="windows of the run to measure")
    parser.add_argument("--throughput", action="store_true", help="also time the four attentions (one GPU)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args(argv)
    stats = skipped_share(args.batches)
    print(", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in stats.items()), flush=True)
    if args.throughput:
        for workload in ("llama3_1b", "llama3_1b_flex_causal", "llama3_1b_flex_docs", "llama3_1b_varlen_docs"):
            subprocess.run([sys.executable, "-m", "benchmarks.throughput", "--workload", workload, "--contenders",
                            "titan", "--rounds", "1", "--steps", str(args.steps), "--warmup", str(args.warmup)],
                           check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
