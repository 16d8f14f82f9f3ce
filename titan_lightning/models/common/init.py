"""Deterministic weight initialization that does not depend on where the weights live.

Every parameter is drawn in full, on CPU, in float32, from a generator seeded by the run
seed and the parameter's name; then each rank keeps its own shard of it. The weights
therefore depend only on (seed, name): not on the device, the dtype, the sharding, the
pipeline split or the order in which modules were built.
"""

import os
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Collection

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_lightning.parallel.nf4 import copy_into_sharded_nf4, sharded_nf4

# Name parts added by wrappers (activation checkpointing, torch.compile); dropped so a
# wrapped model draws the same weights as a plain one.
WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")

# law(fqn, full, generator) fills ``full`` (the whole parameter, float32, CPU) in place.
InitLaw = Callable[[str, torch.Tensor, torch.Generator], None]


def canonical_fqn(fqn: str) -> str:
    for part in WRAPPER_PARTS:
        fqn = fqn.replace(part, "")
    return fqn


def param_generator(seed: int, fqn: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(fqn.encode())) % 2**64)


# A model of more values than this draws its parameters on several threads (each from its own
# generator: the same values as one thread), at most draw_ahead_bytes() of drawn tensors waiting.
PARALLEL_DRAW_NUMEL = 1 << 26
DRAW_AHEAD_BYTES = 8 << 30


def draw_threads() -> int:
    return min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def draw_ahead_bytes() -> int:
    """DRAW_AHEAD_BYTES, or less where the host has less memory available for each process of
    this node (a quarter of its share: every rank draws its whole parameters at once)."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return min(DRAW_AHEAD_BYTES, 1 << 30)  # (no /proc: a bound any host has)
    return min(DRAW_AHEAD_BYTES, available // (4 * max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))


@torch.no_grad()
def init_params(module: nn.Module, seed: int, law: InitLaw, *, skip: Collection[str] = ()) -> None:
    """Draw every parameter of ``module`` by ``law`` but those named in ``skip`` (canonical names:
    ones a load overwrites before they are read keep their storage as it is; each drawn one's values
    depend on (seed, name) alone, so skipping some changes no other). A large model's parameters are
    drawn on ``draw_threads()`` threads (a 70B model's draw is minutes on one core): ``law`` must
    draw from the generator it is given alone (nn.init's functions with ``generator=``)."""
    todo = [(fqn, param) for fqn, param in ((canonical_fqn(n), p) for n, p in module.named_parameters())
            if fqn not in skip]

    def draw(fqn: str, param: torch.Tensor) -> torch.Tensor:
        full = torch.empty(param.shape, dtype=torch.float32, device="cpu")  # whatever the default device
        law(fqn, full, param_generator(seed, fqn))
        return full

    threads = draw_threads() if sum(p.numel() for _, p in todo) > PARALLEL_DRAW_NUMEL else 1
    if threads == 1:
        for fqn, param in todo:
            _copy_in(param, draw(fqn, param))
        return
    budget = draw_ahead_bytes()
    with ThreadPoolExecutor(threads, thread_name_prefix="init") as pool:
        ahead: deque = deque()  # (param, future of its values, bytes), in the module's order
        waiting, nxt = 0, 0
        while ahead or nxt < len(todo):
            while nxt < len(todo) and len(ahead) < 2 * threads and (
                    not ahead or waiting + 4 * todo[nxt][1].numel() <= budget):
                fqn, param = todo[nxt]
                ahead.append((param, pool.submit(draw, fqn, param), 4 * param.numel()))
                waiting, nxt = waiting + ahead[-1][2], nxt + 1
            param, values, size = ahead.popleft()
            _copy_in(param, values.result())
            waiting -= size


def _copy_in(param: torch.Tensor, full: torch.Tensor) -> None:
    if sharded_nf4(param):  # (quantized whole, then this rank's rows: parallel/nf4.py)
        copy_into_sharded_nf4(param, full)
    elif isinstance(param, DTensor):
        # src_data_rank=None: no communication, each rank cuts its own chunk.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)
