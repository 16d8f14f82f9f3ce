"""Optimizer and warmup-stable-decay learning-rate schedule built from the config."""

import math
import warnings
from typing import Callable, Iterable

import torch

from titan_lightning.config import LRScheduleConfig, OptimizerConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], config: OptimizerConfig, device: torch.device):
    implementation = config.implementation
    if implementation is None:
        implementation = "fused" if device.type in ("cuda", "cpu") else "foreach"
    if not config.decay_norms_and_biases:
        params = list(params)
        groups = [[p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]]
        params = [{"params": group, **({"weight_decay": 0.0} if k else {})}
                  for k, group in enumerate(groups) if group]
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=implementation == "fused",
        foreach=implementation == "foreach",
    )


def wsd_lambda(config: LRScheduleConfig, max_steps: int) -> Callable[[int], float]:
    """LR factor for the optimizer step with 0-based index ``step``.

    Warmup rises linearly to 1 over ``warmup_steps`` (or ``warmup_ratio`` of the steps, rounded;
    never 0, so step 0 trains);
    the last ``decay_steps`` fall towards ``min_lr_factor`` along the chosen curve (the
    factor reaches it one step after the end, so the last step still trains).
    """
    decay = None if config.decay_ratio is None else round(config.decay_ratio * max_steps)
    wanted = config.warmup_steps if config.warmup_ratio is None else round(config.warmup_ratio * max_steps)
    warmup = min(wanted, max_steps - (decay or 0))
    if warmup < wanted:
        # As torchtitan does: a quick debugging run keeps its decay and warms up for less.
        warnings.warn(
            f"lr_schedule.warmup_steps={wanted} plus {decay or 0} decay steps exceed "
            f"trainer.max_steps={max_steps}; warming up for {warmup} steps instead"
        )
    decay = max_steps - warmup if decay is None else decay
    stable_end = max_steps - decay

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if step < stable_end or decay == 0:
            return 1.0
        progress = min((step - stable_end) / decay, 1.0)
        if config.decay_type == "linear":
            curve = 1.0 - progress
        elif config.decay_type == "sqrt":
            curve = 1.0 - math.sqrt(progress)
        else:
            curve = 0.5 * (1.0 + math.cos(math.pi * progress))
        return config.min_lr_factor + (1.0 - config.min_lr_factor) * curve

    return factor


def build_lr_scheduler(optimizer, config: LRScheduleConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, wsd_lambda(config, max_steps))
