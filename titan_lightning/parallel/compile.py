"""torch.compile per transformer block, as torchtitan does.

Each block's forward (already wrapped by activation checkpointing, if any) is compiled on its
own, and FSDP's per-block hooks stay outside the compiled code: the blocks share one code
object, so the graph is traced once and reused by every block of the same shape. Parameter
names and the state dict do not change (no ``_orig_mod`` wrapper).

Two cases compile the block's children instead (norms, attention, feed-forward), each on its
own: tensor parallelism (compiling a whole block whose children carry TP's sequence-parallel
input/output hooks fails, or silently gives wrong gradients, in torch 2.13; each child alone,
its own hooks left outside, is exact) and MoE layers (data-dependent token counts: the MoE
child stays eager, the rest of the block is compiled). With ``moe`` a block with an MoE layer
is compiled whole (not under ``per_child``): its token path is static-shaped where nothing reads
the token counts on the host (the grouped GEMM on one device, or padded EP); ``moe_stays_eager``
says where that does not hold, and ``parallelize`` then leaves the MoE layers eager.

A fully checkpointed block with QLoRA's NF4 weights is compiled inside its checkpoint instead
(``recompute_compiled``): the checkpoint stays eager, so the block keeps its input alone whatever
the compiled graph would save (measured on an H100: ~2.2 GiB a block of a 70B-shaped model with the
checkpoint compiled, more than its dequantized weights).
"""

import functools
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from titan_lightning._compat import dynamo_config
from titan_lightning.parallel.activation_checkpoint import recompute_compiled
from titan_lightning.parallel.contracts import grouped_experts, moe_layers
from titan_lightning.parallel.nf4 import holds_nf4


def compile_blocks(blocks: Iterable[nn.Module], *, backend: str = "inductor", fullgraph: bool = True,
                   per_child: bool = False, moe: bool = False, eager_rounding: bool = False) -> int:
    """Compile each block's forward in place (or, with ``per_child`` or an MoE layer inside,
    each of its non-MoE children's; with ``moe``, a block with an MoE layer whole); returns how
    many forwards were compiled. ``eager_rounding``: Inductor rounds each bf16 / fp16 intermediate
    of a fused kernel as eager does (``emulate_precision_casts``), so that a block's forward in a
    training graph and under no_grad (whose fusions differ) compute the same bits: a preference
    run's reference forward is then its policy's at step 1, exactly."""
    blocks = list(blocks)
    options = {"emulate_precision_casts": True} if eager_rounding and backend == "inductor" else None
    compile = functools.partial(torch.compile, backend=backend, options=options)
    if moe and any(moe_layers(block) for block in blocks):
        _count_tokens_once_under_checkpointing()
    count = 0
    for block in blocks:
        has_moe = bool(moe_layers(block))
        if not per_child and (moe or not has_moe):
            whole = fullgraph and not has_moe
            if getattr(block, "activation_checkpoint", None) == "full" and any(
                    holds_nf4(p) for p in block.parameters()):
                # (a compiled checkpoint of a 70B-shaped QLoRA block kept ~2.2 GiB to its backward
                # on an H100, where its input is 64 MiB; an eager checkpoint keeps the input alone
                # whatever the compiled forward saves)
                recompute_compiled(block, functools.partial(compile, fullgraph=whole))
            else:
                block.forward = compile(block.forward, fullgraph=whole)
            block.compiled = backend
            count += 1
            continue
        for child in block.children():
            if moe_layers(child):
                continue
            child.forward = compile(child.forward, fullgraph=fullgraph)
            child.compiled = backend
            count += 1
    return count


def moe_stays_eager(model: nn.Module, *, device_type: str, dtype: torch.dtype, tp: bool,
                    ep_dispatch: Optional[str], experts_sharded_apart: bool = False) -> Optional[str]:
    """Why ``model``'s MoE layers cannot be compiled with their blocks in this layout (their
    token path reads the host, the blocks compile per child, or FSDP hooks sit inside them), or
    None: they can.

    ``dtype``: what the experts compute in; ``ep_dispatch``: expert parallelism's dispatch
    (None: no EP); ``experts_sharded_apart``: the experts are an FSDP unit of their own (FSDP with
    EP). Experts that do not declare ``static_token_path`` are taken to read the host."""
    if tp:
        return "under tensor parallelism each block's children are compiled and the MoE layers stay eager"
    if experts_sharded_apart:
        # Their FSDP hooks (dynamo-disabled) inside a compiled, checkpointed block break the
        # recompute's replay (measured on CPU: models entry deepseek_v3_fsdp2_ep2_padded).
        return "under FSDP with expert parallelism the experts are an FSDP unit of their own inside each block"
    if ep_dispatch == "splits":
        return ("expert parallelism's 'splits' dispatch reads the all-to-all sizes on the host every layer "
                "(parallelism.ep_dispatch='padded' does not)")
    if dtype != torch.bfloat16:
        return f"torch's grouped GEMM is traced in bf16 only, and the experts compute in {dtype}"
    probe = torch.empty(0, device=device_type, dtype=dtype)
    for experts in grouped_experts(model):
        static = getattr(experts, "static_token_path", None)
        if static is None or not static(probe):
            return (f"the experts take the per-expert loop on {device_type} in {dtype}, which reads the token "
                    f"counts on the host (the grouped GEMM: bf16 on CUDA compute capability 9.0+, or "
                    f"model.moe.use_grouped_mm=true where torch has it)")
    return None


def _count_tokens_once_under_checkpointing() -> None:
    """An MoE layer adds its tokens per expert to a buffer in its forward (the load-balancing
    counts). Under activation checkpointing dynamo refuses to trace that side effect inside the
    checkpoint (the whole checkpointed block then runs eagerly, uncompiled) unless told to skip
    it in the backward's recompute. Skipping is right: eager checkpointing replays it and counts
    each token twice, which the sign-based bias update does not notice; compiled, it counts once."""
    config = dynamo_config
    if hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def compile_loss(loss_fn: Callable, *, backend: str = "inductor") -> Callable:
    return torch.compile(loss_fn, backend=backend)
