"""Deterministic weight initialization that does not depend on where the weights live.

Every parameter is drawn in full, on CPU, in float32, from a generator seeded by the run
seed and the parameter's name; then each rank keeps its own shard of it. The weights
therefore depend only on (seed, name): not on the device, the dtype, the sharding, the
pipeline split or the order in which modules were built.
"""

import zlib
from typing import Callable

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


@torch.no_grad()
def init_params(module: nn.Module, seed: int, law: InitLaw) -> None:
    for fqn, param in module.named_parameters():
        fqn = canonical_fqn(fqn)
        full = torch.empty(param.shape, dtype=torch.float32, device="cpu")  # whatever the default device
        law(fqn, full, param_generator(seed, fqn))
        if sharded_nf4(param):  # (quantized whole, then this rank's rows: parallel/nf4.py)
            copy_into_sharded_nf4(param, full)
        elif isinstance(param, DTensor):
            # src_data_rank=None: no communication, each rank cuts its own chunk.
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)
