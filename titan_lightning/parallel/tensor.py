"""Tensor parallelism (TP, with optional sequence parallelism and loss parallelism).

A model declares *what* is sharded with a plan: module-name patterns mapped to style names,
e.g. ``{"layers.*.attention.wq": "colwise"}`` (``*`` matches one name part, so it stands for a
layer index). This file applies a plan; the rest of TP lives in three rooms:

- parallel/tensor_styles.py: the styles a plan may name, one record each (what it shards, the
  ParallelStyle it applies, its float8 form); a new style is one record there.
- parallel/tensor_plan_check.py: a plan checked against the model before anything is sharded,
  and a user's module fitted to it: head counts made per-rank (found by name or declared with
  the style ``heads``), fused q, k, v projections recognized.
- parallel/tensor_shape_errors.py: a shape error of a module's forward under TP re-raised as
  one line naming the module and what to declare (``TensorParallelShapeError``).

Float8 (torchao's Float8Linear, tensorwise recipe: ``apply_tp(float8=True)``): an entry whose
style has a float8 form takes it where the module is a float8 linear, or where its linear
children all are float8 linears taking theirs (a ``prepare_block_input`` block: with sequence
parallelism its input is cast once and all-gathered in float8). The same layouts as the plain
styles; anything else (the high-precision head, a block with a plain linear, MLA's replicated
projections) keeps the plain style.

Weights are not broadcast (``src_data_rank=None``): each rank shards the full weights it
holds. Build the model on the meta device, apply TP, then materialize it (the
layout-independent init gives every rank its own shard); or, for a user's module built
normally, build it with the same seed on every rank: its weights are kept, not re-initialized.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from titan_lightning.parallel.float8 import is_float8_linear
from titan_lightning.parallel.tensor_plan_check import Entry, checked_plan, join
from titan_lightning.parallel.tensor_plan_check import match as _match  # noqa: F401 (test_qwen3_model reads it)
from titan_lightning.parallel.tensor_shape_errors import TensorParallelShapeError  # noqa: F401 (apply_tp's)
from titan_lightning.parallel.tensor_shape_errors import explain_shape_errors
from titan_lightning.parallel.tensor_styles import FUSED, StyleFactory, Target  # noqa: F401 (FUSED: the strategy's)


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: dict[str, str],
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    float8: bool = False,
) -> nn.Module:
    """Shard ``model`` over the 1-D ``tp_mesh`` as ``plan`` says; the model is changed in place.

    The whole plan is checked (style names, patterns, divisible sizes and head counts) before
    anything is sharded. Head counts are then made per-rank (parallel/tensor_plan_check.py), and
    every module that owns sharded children explains a shape error of its forward. With
    ``loss_parallel`` the model returns vocab-sharded DTensor logits: compute the loss and run
    backward inside ``torch.distributed.tensor.parallel.loss_parallel()``. With ``float8``
    (torchao's float8 linears, tensorwise recipe) the float8 linears and the blocks that feed only
    them take their styles' float8 forms (``_float8_entries``).
    """
    tp = tp_mesh.size()
    resolved, heads = checked_plan(model, plan, tp, sequence_parallel)
    float8_entries = _float8_entries(resolved) if float8 else set()
    # (torch's SequenceParallel makes every parameter it replicates trainable: a frozen one, such as a
    # LoRA run's norm, is frozen again)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    for entry in resolved:
        factory: StyleFactory = entry.record.float8 if entry.fqn in float8_entries else entry.record.parallel_style
        parallel_style = factory(Target(entry.module, sequence_parallel, loss_parallel, entry.parts))
        if parallel_style is not None:
            parallelize_module(entry.module, tp_mesh, parallel_style, src_data_rank=None)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    for count in heads:
        setattr(count.owner, count.attr, count.value // tp)
    explain_shape_errors(model, resolved, heads, tp)
    return model


def _float8_entries(resolved: list[Entry]) -> set[str]:
    """The entries that take their style's float8 form, by fqn: a float8 linear, and a block
    whose linear children are all such (its gathered input then meets float8 matmuls only: torchao
    casts it once, before the all-gather). Anything else, such as the high-precision head, keeps
    torch's style."""
    has_float8 = [entry for entry in resolved if entry.record.float8 is not None]
    linears = {entry.fqn for entry in has_float8 if is_float8_linear(entry.module)}

    def fed_float8_only(fqn: str, block: nn.Module) -> bool:
        children = [join(fqn, name) for name, child in block.named_children() if isinstance(child, nn.Linear)]
        return bool(children) and set(children) <= linears

    return linears | {entry.fqn for entry in has_float8 if fed_float8_only(entry.fqn, entry.module)}


def check_tp_plan(model: nn.Module, plan: dict[str, str], tp: int, *, sequence_parallel: bool) -> None:
    """Raise what ``apply_tp`` would raise about ``plan`` on ``model`` at degree ``tp``, changing
    nothing and needing no process group (for a check before launch)."""
    checked_plan(model, plan, tp, sequence_parallel)
