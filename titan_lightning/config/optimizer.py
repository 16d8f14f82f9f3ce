"""Optimizer and learning-rate schedule."""

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["AdamW"] = "AdamW"
    lr: float = 8e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # False: no weight decay on the 1-D parameters (norm weights, biases), the usual fine-tuning
    # setting (recipes.hf:sft); they form a second parameter group.
    decay_norms_and_biases: bool = True
    # None picks fused where the device supports it, else foreach.
    implementation: Optional[Literal["fused", "foreach", "for-loop"]] = None

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr={self.lr} must be > 0")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"optimizer.{name}={value} must be in [0, 1)")
        if not self.eps > 0:
            raise ValueError(f"optimizer.eps={self.eps} must be > 0")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay={self.weight_decay} must be >= 0")


@dataclass(kw_only=True)
class LRScheduleConfig:
    """Warmup-stable-decay: linear warmup, constant, then decay to ``min_lr_factor * lr``."""

    warmup_steps: int = 200
    # Fraction of all steps spent warming up, instead of warmup_steps (then 0): a run whose steps
    # come from its data (trainer.max_epochs) warms up for a share of them.
    warmup_ratio: Optional[float] = None
    # Fraction of all steps spent decaying; None decays over every step after warmup.
    decay_ratio: Optional[float] = None
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    min_lr_factor: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"lr_schedule.warmup_steps={self.warmup_steps!r} must be an integer >= 0")
        if self.warmup_ratio is not None:
            if not 0.0 <= self.warmup_ratio < 1.0:
                raise ValueError(f"lr_schedule.warmup_ratio={self.warmup_ratio} must be in [0, 1), or None")
            if self.warmup_steps:
                raise ValueError(f"lr_schedule.warmup_steps={self.warmup_steps} and lr_schedule.warmup_ratio="
                                 f"{self.warmup_ratio} both set the warmup; set warmup_steps 0 or warmup_ratio null")
        if self.decay_ratio is not None and not 0.0 <= self.decay_ratio <= 1.0:
            raise ValueError(f"lr_schedule.decay_ratio={self.decay_ratio} must be in [0, 1], or None")
        if not 0.0 <= self.min_lr_factor <= 1.0:
            raise ValueError(f"lr_schedule.min_lr_factor={self.min_lr_factor} must be in [0, 1]")
