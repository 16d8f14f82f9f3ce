"""Preference training's frozen reference (``preference.reference="frozen"``) on several ranks: a
second model sharded like the policy, with units of its own, no gradients and no optimizer state."""

import dataclasses
from itertools import chain

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_lightning._compat import unset_fake_temporarily
from titan_lightning.parallel.mesh import Mesh
from titan_lightning.parallel.parallelize import parallelize


def sharded_copy(module, mesh: Mesh) -> nn.Module:
    """A frozen copy of ``module.model`` (a ``CausalLMModule``'s, parallelized and loaded): the same
    model built on the meta device and parallelized by the job's layout as the strategy did the
    policy (TP, CP, float8, compile; FSDP units of its own, a root of its own; no DDP, it has
    nothing to reduce), then each local shard copied from the policy's, which sits in the same
    place of the same mesh. Pipeline stages are not copied (``validate_preference`` refuses them)."""
    holder = nn.Module()  # (the TP plan names its modules from the LightningModule: "model.…")
    # No backward follows the copy's forward, so a unit left gathered after it ("default" keeps the
    # last one for the backward) would stay gathered from step to step: every unit reshards.
    job = module.job
    if job.parallelism.fsdp_reshard_after_forward == "default":
        always = dataclasses.replace(job.parallelism, fsdp_reshard_after_forward="always")
        job = dataclasses.replace(job, parallelism=always)
    # Built and sharded on the meta device as the policy was, also inside the estimator's fake mode
    # (a fake parameter could not be cast in place, as ``allocate`` casts the meta model).
    with unset_fake_temporarily():
        with torch.device("meta"):
            holder.model = module.build_model()
        parallelize(holder, mesh, job, model=holder.model, tp_plan=module.tp_plan, ddp=False)
    copy = holder.model
    module.allocate(module.device, copy)  # (stored as the policy is: dtypes, a LoRA base frozen in the compute dtype)
    policy = module.model
    targets = list(chain(copy.named_parameters(), copy.named_buffers()))
    sources = list(chain(policy.named_parameters(), policy.named_buffers()))
    if len(targets) != len(sources):
        raise RuntimeError(f"the frozen reference holds {len(targets)} tensors, the model {len(sources)}")
    with torch.no_grad():
        for (name, target), (source_name, source) in zip(targets, sources):
            target, source = _local(target), _local(source)
            if name != source_name or target.shape != source.shape or target.dtype != source.dtype:
                raise RuntimeError(f"the frozen reference's {name} {tuple(target.shape)} {target.dtype} is not the "
                                   f"model's {source_name} {tuple(source.shape)} {source.dtype}")
            target.copy_(source)
    return copy.requires_grad_(False)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (DTensor) parameter or buffer."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
