"""Synthetic chat data for the SFT rows of benchmarks/throughput.py, and what share of its trained
tokens the loss supervises.

    python -m benchmarks.sft_data /tmp/titan_sft_bench                  # writes the shard set (~15 s)
    python -m benchmarks.sft_data /tmp/titan_sft_bench --seq-len 8192 --packing packed --windows 60

The set: 40,000 conversations of a realistic length mix (``synthetic_conversations``: a system turn
of 4-12 tokens, then 1-4 user/assistant pairs of lognormal lengths around 200 tokens, sigma 0.8,
so short turns next to turns of 1,000+ tokens), the assistant's tokens supervised, ids of the
shipped tokenizer (the benchmark models' larger vocabularies cost the same). With ``--windows``,
prints, over the first samples a run trains, the conversation tokens (padding not counted) and
the supervised labels per sample and as shares of seq_len (packed: whole conversations back to
back, the rest padding; padded: one conversation per row): a row of seq_len tokens/s x a share
is real or supervised tokens/s.
"""

import argparse
import os
from pathlib import Path

SFT_BENCH_ENV = "TITAN_SFT_BENCH"  # the set's folder, read by the SFT workloads of throughput.py
DEFAULT = "/tmp/titan_sft_bench"


def write(folder: Path, n: int = 40_000) -> Path:
    from titan_lightning.data.shards import INDEX
    from titan_lightning.data.tokenizer import load_tokenizer
    from titan_lightning.testing.sft_shards import synthetic_conversations, write_sft_shards

    if (folder / INDEX).is_file():
        return folder
    tokenizer = load_tokenizer()
    conversations = synthetic_conversations(n, seed=0, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eot_id,
                                            mean_turn=200, max_turns=4)
    return write_sft_shards(folder, conversations)


def window_stats(folder: Path, seq_len: int, packing: str, windows: int) -> dict[str, float]:
    """Per sample, over the first ``windows``: the conversation tokens it holds (padding not
    counted) and the supervised labels, each also as a share of ``seq_len``."""
    from titan_lightning.data.shards import ShardSet
    from titan_lightning.data.sft import ConversationWindows
    from titan_lightning.data.tokenizer import load_tokenizer
    from titan_lightning.models.common.loss import IGNORE_INDEX

    shards = ShardSet(folder)
    data = ConversationWindows(shards.tokens, seq_len, load_tokenizer().eot_id, packing=packing)
    count = min(windows, len(data))
    real = supervised = 0
    for i in range(count):
        real += min(sum(e - b for b, e in data.spans(i)), seq_len)
        supervised += int((data[i]["labels"] != IGNORE_INDEX).sum())
    return {"tokens_per_sample": real / count, "supervised_per_sample": supervised / count,
            "tokens_share": real / count / seq_len, "supervised_share": supervised / count / seq_len}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", default=os.environ.get(SFT_BENCH_ENV, DEFAULT), type=Path)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--packing", default="packed", choices=("packed", "best_fit", "padded"))
    parser.add_argument("--windows", type=int, default=0)
    args = parser.parse_args()
    write(args.folder)
    if args.windows:
        stats = window_stats(args.folder, args.seq_len, args.packing, args.windows)
        print(f"{args.folder}: {args.packing} samples of seq_len {args.seq_len}, first {args.windows}: "
              + ", ".join(f"{k} {v:.4f}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
