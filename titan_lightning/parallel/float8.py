"""Float8 training through torchao: a model's nn.Linear layers become torchao's Float8Linear.

A Float8Linear keeps its high-precision weight (the parameter, its name, its init and the
optimizer are unchanged); each matmul casts its operands to float8 with dynamic scales (one
per tensor, "tensorwise", or per row, "rowwise") and runs ``torch._scaled_mm``. The swap happens
on the meta device before any other parallelism wraps the layers (parallelize.py), as
torchtitan converts right after building the model. Only nn.Linear converts: MoE routed experts
(grouped GEMMs over 3-D parameters) stay in high precision.

Under tensor parallelism the tensorwise recipe (``Float8Config.float8_tensor_parallel``) shards
the float8 linears with torchao's float8 forms of the TP styles (``float8_tp_styles``, a style's
``float8`` in parallel/tensor_styles.py, picked per module in parallel/tensor.py): the same
layouts, but a sequence-parallel input is cast to float8 before its all-gather and the output's
gradient is cast in the backward, as torchtitan's ``enable_float8_tensorwise_tp``. The rowwise
recipe keeps torch's styles around the float8 linears (torchao's styles cast per tensor).

With LoRA the adapted linears (lora/layer.py's LoRALinear) keep their module and frozen weight; their
base matmul runs in float8 (``frozen_float8_linear``: the operands cast as torchao's Float8Linear
casts them, the backward computing the input's gradient alone, as a frozen weight needs), the
adapters in the compute dtype. Linears without adapters convert as above.

torchao is imported only here and only when float8 is on (the ``float8`` extra).
"""

import dataclasses
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from titan_lightning._compat import set_inductor_emulate_precision_casts
from titan_lightning.config.quantize import Float8Config


def _names(fqn: str, name: str) -> bool:
    """``name`` is a run of whole dotted parts of ``fqn`` ("output" names "output", not "output_proj")."""
    parts, wanted = fqn.split("."), name.split(".")
    return any(parts[i:i + len(wanted)] == wanted for i in range(len(parts) - len(wanted) + 1))


def float8_filter(config: Float8Config) -> Callable[[nn.Module, str], bool]:
    """Which modules convert: plain nn.Linear (a subclass may change what its forward does, as the
    decoder's Head does for the chunked loss: Float8Linear would drop that) whose dimensions divide
    by 16 (float8 kernels need it), none below ``min_dim``, and none whose name matches ``filter_fqns``."""

    def convertible(module: nn.Module, fqn: str) -> bool:
        return type(module) is nn.Linear and _fits(module, fqn, config)

    return convertible


def _fits(module: nn.Module, fqn: str, config: Float8Config) -> bool:
    """Dimensions float8 kernels take, none below ``min_dim``, a name ``filter_fqns`` leaves alone."""
    out_features, in_features = module.weight.shape
    if out_features % 16 or in_features % 16 or min(out_features, in_features) < config.min_dim:
        return False
    return not any(_names(fqn, name) for name in config.filter_fqns)


def torchao_config(config: Float8Config):
    """torchao's Float8LinearConfig for ``config``: the recipe, emulation and the FSDP all-gather."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(config.recipe), emulate=config.emulate,
                               enable_fsdp_float8_all_gather=config.enable_fsdp_float8_all_gather)


def convert_to_float8(model: nn.Module, config: Float8Config) -> list[str]:
    """Swap ``model``'s convertible linears for Float8Linear in place; their names, in module order."""
    from torchao.float8 import convert_to_float8_training

    convertible, converted = float8_filter(config), []

    def keep(module: nn.Module, fqn: str) -> bool:
        if convertible(module, fqn):
            converted.append(fqn)
            return True
        return False

    if isinstance(model, nn.Linear):  # (torchao returns a new root instead of swapping in place)
        raise ValueError(f"float8 converts the linears inside a model, not a bare {type(model).__name__}")
    convert_to_float8_training(model, module_filter_fn=keep, config=torchao_config(config))
    adapted = [(fqn, m) for fqn, m in model.named_modules()  # (LoRALinear; the experts' adapters stay bf16)
               if isinstance(m, nn.Linear) and hasattr(m, "lora_a") and _fits(m, fqn, config)]
    if adapted:
        base = float8_base(config)
        for fqn, module in adapted:
            module.float8 = base
            converted.append(fqn)
    if config.recipe == "rowwise":
        # Inductor otherwise rounds the rowwise casts differently from eager (pytorch/pytorch#150859);
        # torchtitan sets it too.
        set_inductor_emulate_precision_casts()
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(converted, key=order.__getitem__)


class Float8Base(NamedTuple):
    """What an adapted linear's frozen base needs for its float8 matmul: torchao's config and the
    GEMM configs its Float8Linear derives from it."""

    config: Any  # torchao's Float8LinearConfig
    mm_config: Any  # torchao's LinearMMConfig


def float8_base(config: Float8Config) -> Float8Base:
    from torchao.float8.float8_linear import Float8Linear

    ao = torchao_config(config)
    probe = Float8Linear(16, 16, bias=False, config=ao, device="meta")  # (torchao derives its GEMM configs)
    return Float8Base(ao, probe.linear_mm_config)


def frozen_float8_linear(x: torch.Tensor, weight: torch.Tensor, base: Float8Base) -> torch.Tensor:
    """``x W^T`` for a frozen ``W``: both operands cast to float8 with dynamic scales as torchao's
    Float8Linear casts them (under autocast, ``x`` first in the autocast dtype); the backward
    computes ``x``'s gradient alone and keeps only ``W`` for it (Float8Linear's also computes the
    weight's gradient, and keeps ``x``)."""
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return _FrozenFloat8Matmul.apply(x, weight.t(), base.mm_config, base.config)


def _cast(t: torch.Tensor, cast: Any, mm_config: Any, role: str, axis: int, config: Any) -> torch.Tensor:
    """``t`` in float8 as ``cast`` (a torchao CastConfig) says, scaled along ``axis`` when per row."""
    from torchao.float8.config import ScalingType
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    if tensor_already_casted_to_fp8(t) or cast.scaling_type is ScalingType.DISABLED:
        return t
    return hp_tensor_to_float8_dynamic(t, cast.target_dtype, mm_config, gemm_input_role=GemmInputRole(role),
                                       scaling_granularity=cast.scaling_granularity,
                                       axiswise_dim=get_maybe_axiswise_dim(axis, cast.scaling_granularity),
                                       round_scales_to_power_of_2=config.round_scales_to_power_of_2)


@torch._dynamo.allow_in_graph  # (as torchao's own matmul: traced by AOTAutograd, float8 tensors inside)
class _FrozenFloat8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_t, mm_config, config):
        ctx.save_for_backward(weight_t)
        ctx.mm_config, ctx.config = mm_config, config
        x8 = _cast(x, config.cast_config_input, mm_config, "input", -1, config)
        w8 = _cast(weight_t, config.cast_config_weight, mm_config, "weight", 0, config)
        out = torch.mm(x8.reshape(-1, x8.shape[-1]), w8)
        return out.reshape(*x8.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        (weight_t,) = ctx.saved_tensors
        c = ctx.config
        g8 = _cast(grad.reshape(-1, grad.shape[-1]), c.cast_config_grad_output, ctx.mm_config, "grad_output", -1, c)
        w8 = _cast(weight_t, c.cast_config_weight_for_grad_input, ctx.mm_config, "weight", -1, c)
        grad_x = torch.mm(g8, w8.t())
        return grad_x.reshape(*grad.shape[:-1], grad_x.shape[-1]), None, None, None


def is_float8_linear(module: nn.Module) -> bool:
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


class Float8TPStyles(NamedTuple):
    colwise: type
    rowwise: type
    prepare_input: type


def float8_tp_styles() -> Float8TPStyles:
    """torchao's float8 forms of ColwiseParallel, RowwiseParallel and PrepareModuleInput."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8TPStyles(Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput)


def precompute_float8_scales(module: nn.Module) -> None:
    """After an optimizer step: the float8 scales of every FSDP-sharded weight in one all-reduce
    (``quantize.float8.precompute_float8_dynamic_scale_for_fsdp``)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(module)
