"""The order in which a job's parallelisms are applied to a model, as one function.

    float8 -> PP split -> TP -> CP -> EP (or expert TP) -> activation checkpointing -> compile -> FSDP or DDP

torchtitan's order: TP first (it swaps parameters for DTensors and adds hooks the later steps
wrap), activation checkpointing and compile wrap each block's forward, FSDP last (its
per-block hooks stay outside the compiled and checkpointed code). Float8 (torchao) goes before
all of them, as torchtitan converts the model right after building it: it swaps the linears
themselves, so everything after wraps the float8 ones (TP gives them torchao's float8 styles
under the tensorwise recipe, and FSDP's float8 all-gather finds their weights). Under PP the
model is then cut into stages and each of this rank's stages is an FSDP root of its own, as the
schedule expects. Nothing is materialized: a model built on the meta
device stays there.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from titan_lightning.config import JobConfig
from titan_lightning.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_lightning.parallel.compile import compile_blocks, moe_stays_eager
from titan_lightning.parallel.context import ContextParallel, apply_context_parallel
from titan_lightning.parallel.contracts import grouped_experts, moe_layers
from titan_lightning.parallel.expert import apply_expert_parallel, apply_expert_tensor_parallel
from titan_lightning.parallel.float8 import convert_to_float8
from titan_lightning.parallel.fsdp import apply_ddp, apply_fsdp, model_blocks
from titan_lightning.parallel.mesh import Mesh
from titan_lightning.parallel.pipeline import PipelinePlan, PipelineSplit, split_pipeline
from titan_lightning.parallel.tensor import apply_tp


@dataclass
class Parallelized:
    """What the run needs of what ``parallelize`` applied."""

    cp: Optional[ContextParallel] = None  # shards each batch's sequences (ContextParallel.shard)
    loss_parallel: bool = False  # the logits come out vocab-sharded: the loss runs in loss_parallel()
    pipeline: Optional[PipelineSplit] = None  # this rank's pipeline stages
    fsdp_roots: list[nn.Module] = field(default_factory=list)
    float8: list[str] = field(default_factory=list)  # the linears now float8 (names within ``model``)
    notes: list[str] = field(default_factory=list)  # what was left undone and why, for the log


def parallelize(
    module: nn.Module,
    mesh: Mesh,
    job: JobConfig,
    *,
    model: Optional[nn.Module] = None,
    tp_plan: Optional[dict[str, str]] = None,
    pipeline_plan: Optional[PipelinePlan] = None,
    blocks: Optional[list[nn.Module]] = None,
    fsdp: bool = True,
    ddp: bool = True,
) -> Parallelized:
    """Apply ``job.parallelism`` to ``module`` over ``mesh``, in the order above.

    ``module`` is what ``tp_plan``'s names are relative to (None: no TP here, the module
    applied its own); ``model`` (default ``module``) the network inside it that CP, EP,
    activation checkpointing (``job.activation_checkpoint``), compile (``job.compile``) and
    FSDP apply to; ``blocks`` its repeated blocks (default ``model_blocks(model)``). Under PP
    ``pipeline_plan`` says where ``module`` keeps what is split. ``fsdp=False``: the module
    sharded itself, no data parallelism here; ``ddp=False``: replicas are left alone (under the
    fake process group DDP's all-reduce moves no data, and its reducer refuses fake futures).
    FSDP computes in ``job.training.mixed_precision_param``, reduces in ``mixed_precision_reduce``.
    ``job.quantize.float8`` swaps ``model``'s linears for float8 ones before anything else.
    """
    dims, p = mesh.dims, job.parallelism
    model = module if model is None else model
    result = Parallelized()
    if job.quantize.float8.enable:
        result.float8 = convert_to_float8(model, job.quantize.float8)
    if dims.pp_enabled:
        result.pipeline = split_pipeline(module, pipeline_plan, p, mesh.rank_and_size("pp")[0])
    if dims.tp_enabled and tp_plan is not None:
        apply_tp(module, mesh.get("tp"), tp_plan, sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel,
                 float8=job.quantize.float8.float8_tensor_parallel)
        result.loss_parallel = p.loss_parallel
    if dims.cp_enabled:
        result.cp = apply_context_parallel(model, mesh.get("cp"), p.cp_load_balancer)
    if dims.ep_enabled:
        apply_expert_parallel(model, mesh.get("ep"), p.ep_dispatch)
    elif dims.tp_enabled and grouped_experts(model):
        apply_expert_tensor_parallel(model, mesh.get("tp"))
    blocks = model_blocks(model) if blocks is None else blocks
    ac, compile = job.activation_checkpoint, job.compile
    if ac.mode != "none":
        apply_activation_checkpointing(blocks, ac.mode, ac.selective_ac_option)
    if compile.enable and "model" in compile.components:
        moe = "moe" in compile.components and bool(moe_layers(model))
        if moe:
            # (what the blocks compute in: autocast's or FSDP's dtype; full-bf16 training needs it bf16)
            dtype = getattr(torch, job.training.mixed_precision_param)
            reason = moe_stays_eager(model, device_type=mesh.device_mesh.device_type, dtype=dtype,
                                     tp=dims.tp_enabled, ep_dispatch=p.ep_dispatch if dims.ep_enabled else None,
                                     experts_sharded_apart=fsdp and dims.fsdp_enabled and mesh.expert_fsdp_mesh() is not None)
            if reason is not None:
                result.notes.append(f"compile: MoE layers stay eager: {reason}")
                moe = False
        pref = job.preference  # (a reference forward under no_grad: the policy's bits at step 1)
        compile_blocks(blocks, backend=compile.backend, fullgraph=compile.fullgraph, per_child=dims.tp_enabled,
                       moe=moe, eager_rounding=pref.enabled and pref.needs_reference)
    if not fsdp:
        return result
    if dims.fsdp_enabled:
        stages = result.pipeline.stages if result.pipeline is not None else None
        roots = [(model, blocks)] if stages is None else [(stage, model_blocks(stage)) for stage in stages]
        t = job.training
        for root, root_blocks in roots:
            apply_fsdp(root, mesh.fsdp_mesh(), param_dtype=getattr(torch, t.mixed_precision_param),
                       reduce_dtype=getattr(torch, t.mixed_precision_reduce),
                       reshard_after_forward=p.fsdp_reshard_after_forward, cpu_offload=p.fsdp_cpu_offload,
                       blocks=root_blocks, expert_mesh=mesh.expert_fsdp_mesh())
        result.fsdp_roots = [root for root, _ in roots]
    elif dims.dp_replicate_enabled and ddp:  # (PP over DDP is refused by validate_degrees)
        apply_ddp(model, mesh.get("dp_replicate"))
    return result
