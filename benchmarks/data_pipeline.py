"""The data pipeline at scale on the CPU machine: prepare throughput, and what reading a large
shard set costs (setup time, resident memory per rank, loader tokens/s).

    python -m benchmarks.data_pipeline prepare --gib 1.0 --workers 1,2
    python -m benchmarks.data_pipeline load --tokens 1e9 --world-size 4

``prepare`` writes a JSONL corpus of about ``--gib`` GiB (the shipped corpus's documents, each
line with a counter so no two are the same text) and runs ``titan-lightning prepare`` on it with
each worker count, reporting tokens/s in total and per worker.

``load`` writes a shard set of ``--tokens`` random tokens (uint16, documents of 100-4,000
tokens) with numpy, then: the data module's ``setup`` time (index, splits by document), the
resident memory of each of ``--world-size`` gloo ranks after setup and 200 batches of the train
loader, and the loader's tokens/s from one core (batches of 8 x 2048, one process, no workers).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def write_jsonl(path: Path, gib: float) -> int:
    from titan_lightning.data.tokenizer import reference_documents

    documents, written, k = reference_documents(), 0, 0
    with path.open("w") as f:
        while written < gib * 2**30:
            line = json.dumps({"id": k, "text": f"[{k}] {documents[k % len(documents)]}"}) + "\n"
            f.write(line)
            written += len(line)
            k += 1
    return written


def bench_prepare(gib: float, workers: list[int]) -> None:
    from titan_lightning.data.prepare import prepare

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        size = write_jsonl(corpus, gib)
        print(f"corpus: {size / 2**30:.2f} GiB of JSONL")
        print("| workers | tokens | seconds | tokens/s | tokens/s per worker | MB/s |")
        print("|---|---|---|---|---|---|")
        for n in workers:
            start = time.perf_counter()
            summary = prepare([str(corpus)], str(Path(tmp) / f"out{n}"), workers=n, progress=False)
            seconds = time.perf_counter() - start
            rate = summary["tokens"] / seconds
            print(f"| {n} | {summary['tokens']:,} | {seconds:.1f} | {rate:,.0f} | {rate / n:,.0f} | "
                  f"{size / seconds / 1e6:.1f} |")


def write_shards(folder: Path, tokens: int, shard_tokens: int = 2**28) -> None:
    from titan_lightning.data.shards import ShardWriter, token_dtype, tokenizer_identity, write_index
    from titan_lightning.data.tokenizer import TOKENIZER_PATH, load_tokenizer

    tokenizer = load_tokenizer()
    folder.mkdir(parents=True)
    generator = np.random.default_rng(0)
    writer = ShardWriter(folder, "part-00000", token_dtype(tokenizer.vocab_size), shard_tokens)
    written = 0
    while written < tokens:
        block = generator.integers(1, tokenizer.vocab_size, size=2**22, dtype=np.int64)
        ends = np.cumsum(generator.integers(100, 4000, size=2**22 // 100))
        ends = ends[ends < len(block)]
        block[ends] = tokenizer.eot_id  # documents end with EOS
        for doc in np.split(block, ends + 1):
            if len(doc):
                writer.add(doc)
        written += len(block)
    identity = tokenizer_identity(TOKENIZER_PATH, tokenizer.vocab_size, tokenizer.eot_id, None)
    write_index(folder, token_dtype(tokenizer.vocab_size), identity, writer.close())


def _job(folder: str):
    from recipes.tests import features

    job = features.llama3_debugmodel().job
    job.data.dataset_path = folder
    job.training.seq_len = 2048
    job.training.tokens_per_microbatch_per_dp_rank = 8 * 2048
    job.model.max_seq_len = 2048
    return job


def _resident_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def measure_rank(rank: int, world_size: int, folder: str, batches: int = 200) -> dict:
    """One gloo rank: the data module's setup, then ``batches`` train batches of its shard."""
    from titan_lightning.data.datamodule import TextDataModule

    module = TextDataModule(_job(folder))
    module._dp = lambda: (world_size, rank)  # the Trainer's distributed_sampler_kwargs
    before = _resident_mib()
    start = time.perf_counter()
    module.setup("fit")
    setup = time.perf_counter() - start
    loader = iter(module.train_dataloader())
    for _ in range(batches):
        next(loader)
    return {"setup_s": setup, "resident_mib": _resident_mib(), "before_mib": before}


def bench_load(tokens: float, world_size: int) -> None:
    from titan_lightning.data.datamodule import TextDataModule
    from titan_lightning.testing.spawn import run_function

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "shards"
        start = time.perf_counter()
        write_shards(folder, int(tokens))
        index = json.loads((folder / "index.json").read_text())
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"shard set: {index['total_tokens']:,} tokens, {index['documents']:,} documents, {len(index['shards'])} "
              f"shards, {size / 2**30:.2f} GiB (written in {time.perf_counter() - start:.0f} s)")
        results = run_function("benchmarks.data_pipeline:measure_rank", world_size, out_dir=Path(tmp) / "logs",
                               timeout=600, folder=str(folder))
        print(f"setup per rank: {max(r['setup_s'] for r in results):.2f} s (max of {world_size}); resident memory "
              f"after setup and 200 batches: {max(r['resident_mib'] for r in results):.0f} MiB (max), of which "
              f"{max(r['before_mib'] for r in results):.0f} MiB before setup (torch, Lightning, the recipe)")
        module = TextDataModule(_job(str(folder)))
        module.setup("fit")
        loader = iter(module.train_dataloader())
        next(loader)
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < 10:
            count += next(loader)["input_ids"].numel()
        print(f"loader: {count / (time.perf_counter() - start):,.0f} tokens/s from one core "
              f"(batches of 8 x 2048, num_workers=0)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--workers", default="1,2")
    p = sub.add_parser("load")
    p.add_argument("--tokens", type=float, default=1e9)
    p.add_argument("--world-size", type=int, default=4)
    options = parser.parse_args()
    if options.what == "prepare":
        bench_prepare(options.gib, [int(n) for n in options.workers.split(",")])
    else:
        bench_load(options.tokens, options.world_size)


if __name__ == "__main__":
    main()
