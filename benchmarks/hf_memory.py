"""Host memory of loading a Hugging Face checkpoint into an FSDP-sharded model, per rank (CPU, gloo).

    python -m benchmarks.hf_memory --gib 1.2 --world-size 4

Writes a Llama-shaped bf16 checkpoint of about ``--gib`` GiB (sharded files and an index, as
Hugging Face publishes them), then on ``--world-size`` gloo ranks builds the fp32 model on the
meta device, shards it with FSDP2 over every rank, materializes it (its pages touched, so the
model's own shards are not counted) and loads the checkpoint, once per method:

    blocks   what LoadWeights does: each rank reads only the blocks of each tensor it keeps
    full     every rank reads the whole checkpoint, converts it, and keeps its shards

and prints each rank's peak resident memory growth during the load (sampled every 2 ms from
/proc/self/statm: anonymous memory plus the file pages a rank touched) against the
checkpoint's size. tests/integration_tests/test_hf_folders.py asserts the ``blocks`` bound.
"""

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch

from titan_lightning.models.llama3 import Llama3Args, Llama3StateDictAdapter

PAGE = 4096


def checkpoint_args(gib: float) -> Llama3Args:
    """A Llama shape whose bf16 parameters take about ``gib`` GiB (16 blocks of width 1024)."""
    per_layer = 15 * 2**20 + 2 * 1024  # q, o: 1M; k, v: 0.5M; SwiGLU 3 x 4M; two norms
    vocab = max(1024, int((gib * 2**30 / 2 - 16 * per_layer) / (2 * 1024)) // 1024 * 1024)
    return Llama3Args(vocab_size=vocab, dim=1024, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=4096,
                      max_seq_len=256, rope_scaling=None)


def make_checkpoint(folder: Path, gib: float, max_shard_bytes: int = 2**29) -> int:
    """A random Hugging Face checkpoint (config.json, safetensors shards, index); its bytes."""
    from titan_lightning.models.common.hf_checkpoint import save_hf_safetensors
    from titan_lightning.models.llama3 import Transformer

    args = checkpoint_args(gib)
    with torch.device("meta"):
        model = Transformer(args)
    generator = torch.Generator().manual_seed(0)
    state = {name: (torch.randn(t.shape, generator=generator) * 0.02).bfloat16()
             for name, t in model.state_dict().items()}
    adapter = Llama3StateDictAdapter(args)
    save_hf_safetensors(adapter.to_hf(state), folder, max_shard_bytes)
    (folder / "config.json").write_text(json.dumps(adapter.hf_config(args)))
    return sum(t.nbytes for t in state.values())


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def measure(rank: int, world_size: int, folder: str, method: str = "blocks") -> dict:
    """On one rank (spawned with titan_lightning.testing.spawn): build, shard and load; the peak
    growth of resident memory during the load, and a checksum of what this rank holds."""
    import gc

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titan_lightning.checkpoint import load_full_state_dict
    from titan_lightning.models.common.hf_checkpoint import load_hf_safetensors
    from titan_lightning.models.llama3 import Transformer
    from titan_lightning.pretrained import read_hf_model

    args = read_hf_model(folder).args
    with torch.device("meta"):
        model = Transformer(args)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()  # resident before the measurement
    adapter = Llama3StateDictAdapter(args)
    gc.collect()
    before = peak = _resident()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _resident())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    if method == "blocks":
        adapter.load_into(model, folder)
    else:
        load_full_state_dict(model, adapter.from_hf(load_hf_safetensors(folder)), source=folder)
    seconds = time.perf_counter() - start
    gc.collect()
    peak = max(peak, _resident())
    done.set()
    sampler.join()
    checksum = torch.tensor([sum(p.to_local().double().sum().item() for p in model.parameters())], dtype=torch.float64)
    dist.all_reduce(checksum)
    return {"growth": peak - before, "seconds": seconds, "checksum": checksum.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.2)
    parser.add_argument("--world-size", type=int, default=4)
    options = parser.parse_args()
    from titan_lightning.testing.spawn import run_function

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "checkpoint"
        size = make_checkpoint(folder, options.gib)
        print(f"checkpoint: {size / 2**30:.2f} GiB bf16 into an fp32 model, {options.world_size} ranks, "
              f"FSDP over every rank")
        print("| method | peak growth per rank, GiB (max over ranks) | vs checkpoint | load s |")
        print("|---|---|---|---|")
        for method in ("blocks", "full"):
            results = run_function("benchmarks.hf_memory:measure", options.world_size, out_dir=Path(tmp) / method,
                                   timeout=600, folder=str(folder), method=method)
            growth = max(r["growth"] for r in results)
            seconds = max(r["seconds"] for r in results)
            print(f"| {method} | {growth / 2**30:.2f} | {growth / size:.2f}x | {seconds:.1f} |")


if __name__ == "__main__":
    main()
