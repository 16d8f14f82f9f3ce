"""Activation checkpointing per transformer block: none, full, selective.

- ``full``: every block keeps only its inputs; its forward runs again in the backward.
- ``selective`` with ``selective_ac_option="N"`` (an integer): every N-th block is fully
  checkpointed (blocks N-1, 2N-1, ... counting from 0), the others keep everything.
- ``selective`` with ``"op"``: every block is checkpointed, but the outputs of the
  expensive ops (matmuls, attention kernels, reduce-scatters) are saved and only the cheap
  elementwise work is recomputed.
- ``selective`` with ``"op_lean"``: as ``"op"``, but every second matmul of a block (``aten.mm``,
  counted in forward order) is recomputed too: torchtitan's per-op policy. In a Llama block that
  recomputes wk, wo and w3: about 2 GiB less on Llama 3 1B at seq 8192 for ~3% more compute
  (benchmarks/RESULTS.md "Memory against torchtitan").

Applied after TP/CP and before FSDP (as torchtitan does): the block's own forward is
wrapped, so parameter names, the state dict and FSDP's per-block hooks are unchanged.
"""

import importlib
import importlib.util
from functools import partial
from typing import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titan_lightning.config.activation_checkpoint import MODES, PER_OP_OPTIONS


def _saved_ops() -> set:
    aten = torch.ops.aten
    names = ["mm.default", "addmm.default", "bmm.default", "_scaled_mm.default",  # (float8 matmuls: torchao)
             "_scaled_dot_product_efficient_attention.default", "_scaled_dot_product_flash_attention.default",
             "_scaled_dot_product_cudnn_attention.default", "_scaled_dot_product_flash_attention_for_cpu.default",
             "_efficient_attention_forward.default", "_grouped_mm.default"]
    ops = set()
    for name in names:
        packet, _, overload = name.partition(".")
        if hasattr(aten, packet):
            ops.add(getattr(getattr(aten, packet), overload))
    # FlexAttention (a higher-order op) and varlen FlashAttention (torch.ops.torch_attn, where this torch has it).
    higher_order = getattr(torch.ops, "higher_order", None)
    if higher_order is not None and hasattr(higher_order, "flex_attention"):
        ops.add(higher_order.flex_attention)
    if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
        importlib.import_module("torch.nn.attention.varlen")  # registers torch.ops.torch_attn
        ops.add(torch.ops.torch_attn._varlen_attn.default)
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.add(functional.reduce_scatter_tensor.default)
    return ops


def _op_policy(saved: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _lean_policy(saved: set, counts: dict, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """``_op_policy`` but every second ``aten.mm`` recomputed; ``counts`` is per block call, kept
    apart for the forward and the recompute so both see the same numbering."""
    if op == torch.ops.aten.mm.default:
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] = counts.get(key, 0) + 1
        if counts[key] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return _op_policy(saved, ctx, op)


def _op_context():
    return create_selective_checkpoint_contexts(partial(_op_policy, _saved_ops()))


def _lean_context():
    return create_selective_checkpoint_contexts(partial(_lean_policy, _saved_ops(), {}))


def checkpoint_block(block: nn.Module, per_op: bool = False, lean: bool = False) -> None:
    """Make ``block``'s forward recompute in the backward (saving matmul outputs if ``per_op``;
    every second one of them recomputed too if ``lean``). ``block.recomputed_forward`` is the
    forward the checkpoint runs (``recompute_compiled`` compiles it)."""
    forward = block.forward
    extra = {"context_fn": _lean_context if lean else _op_context} if per_op else {}

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    block.forward = checkpointed
    block.recomputed_forward = forward
    block.activation_checkpoint = ("op_lean" if lean else "op") if per_op else "full"


def recompute_compiled(block: nn.Module, compile: Callable) -> None:
    """Compile what the full checkpoint of ``block`` recomputes (``compile`` of its
    ``recomputed_forward``) and keep the checkpoint outside, eager, rather than compiling the
    checkpoint: the block then keeps its inputs alone, whatever the compiler's partitioner would
    have saved of a compiled checkpoint (parallel/compile.py: blocks with QLoRA's NF4 weights)."""
    if block.activation_checkpoint != "full":
        raise ValueError(f"recompute_compiled: the block is checkpointed {block.activation_checkpoint!r}, not 'full'")
    block.forward = compile(block.recomputed_forward)
    checkpoint_block(block)


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: str, selective_ac_option: str = "op") -> int:
    """Checkpoint ``blocks`` per ``mode``; returns how many blocks were wrapped."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpoint.mode={mode!r} is not one of {', '.join(MODES)}")
    if mode == "none":
        return 0
    blocks = list(blocks)
    if mode == "full" or selective_ac_option in PER_OP_OPTIONS:
        for block in blocks:
            checkpoint_block(block, per_op=mode == "selective", lean=selective_ac_option == "op_lean")
        return len(blocks)
    every = int(selective_ac_option)
    chosen = blocks[every - 1::every]
    for block in chosen:
        checkpoint_block(block)
    return len(chosen)
