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

torchao is imported only here and only when float8 is on (the ``float8`` extra).
"""

import dataclasses
from typing import Callable, NamedTuple

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
        if type(module) is not nn.Linear:
            return False
        out_features, in_features = module.weight.shape
        if out_features % 16 or in_features % 16 or min(out_features, in_features) < config.min_dim:
            return False
        return not any(_names(fqn, name) for name in config.filter_fqns)

    return convertible


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
    if config.recipe == "rowwise":
        # Inductor otherwise rounds the rowwise casts differently from eager (pytorch/pytorch#150859);
        # torchtitan sets it too.
        set_inductor_emulate_precision_casts()
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(converted, key=order.__getitem__)


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
