"""Several linears applied to one input (a block's q / k / v, its gate / up): ``project``.

Plain linears are each called as they are; layers that compute something of their input jointly
(``LoRALinear``: its adapter's A, titan_lightning/lora/layer.py) provide ``together(x, linears)``,
found on the first layer's type, so the models need not know of adapters.
"""

import torch
from torch import nn


def project(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """``(linear(x) for linear in linears)``, computed jointly where the layers can."""
    together = getattr(type(linears[0]), "together", None)
    return together(x, linears) if together is not None else tuple(linear(x) for linear in linears)
