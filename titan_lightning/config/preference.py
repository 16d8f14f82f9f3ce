"""Preference training on chosen / rejected pairs (``titan-lightning prepare --preference``)."""

from dataclasses import dataclass
from typing import Optional

# DPO (the sigmoid loss), IPO, SimPO (reference-free): titan_lightning/objectives/preference.py.
PREFERENCE_LOSSES = ("dpo", "ipo", "simpo")
# Where the reference model's log-probabilities come from: one pass of the starting weights over the
# pairs before training, stored next to the shards ("precomputed": training holds one model); a
# frozen copy sharded like the policy ("frozen"); the policy with its LoRA adapters switched off
# ("adapters_off").
REFERENCES = ("precomputed", "frozen", "adapters_off")
# beta when it is not given: TRL's DPOConfig for DPO and IPO, the SimPO paper's for SimPO.
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0}


@dataclass(kw_only=True)
class PreferenceConfig:
    """``loss`` None: not a preference run (pretraining or SFT). Else the run trains on the pairs of a
    shard set prepared with ``--preference``, the loss averaged over the pairs of each optimizer step.

    ``beta``: the KL strength of DPO and IPO (IPO's target margin is 1 / (2 beta)), SimPO's reward
    scale; None: 0.1 for DPO and IPO, 2.0 for SimPO. ``gamma``: SimPO's target reward margin (TRL's
    ``simpo_gamma``). ``label_smoothing``: the probability that a pair's labels are flipped
    (conservative DPO, cDPO; DPO and SimPO). ``reference``: see ``REFERENCES`` (SimPO uses none)."""

    loss: Optional[str] = None
    beta: Optional[float] = None
    gamma: float = 1.0
    label_smoothing: float = 0.0
    reference: str = "precomputed"

    def __post_init__(self) -> None:
        if self.loss is not None and self.loss not in PREFERENCE_LOSSES:
            raise ValueError(f"preference.loss={self.loss!r} is not one of {', '.join(PREFERENCE_LOSSES)} (or None: "
                             f"no preference training)")
        if self.beta is not None and not (isinstance(self.beta, (int, float)) and self.beta > 0):
            raise ValueError(f"preference.beta={self.beta!r} must be > 0 (None: the loss's default)")
        if not isinstance(self.gamma, (int, float)) or self.gamma < 0:
            raise ValueError(f"preference.gamma={self.gamma!r} must be >= 0 (SimPO's target reward margin)")
        if not (isinstance(self.label_smoothing, (int, float)) and 0 <= self.label_smoothing < 0.5):
            raise ValueError(f"preference.label_smoothing={self.label_smoothing!r} must be in [0, 0.5)")
        if self.label_smoothing and self.loss == "ipo":
            raise ValueError(f"preference.label_smoothing={self.label_smoothing} applies to dpo and simpo; IPO has "
                             f"none: set it to 0")
        if self.reference not in REFERENCES:
            raise ValueError(f"preference.reference={self.reference!r} is not one of {', '.join(REFERENCES)}")

    @property
    def enabled(self) -> bool:
        return self.loss is not None

    @property
    def needs_reference(self) -> bool:
        """SimPO is reference-free; DPO and IPO compare with the reference model."""
        return self.loss in ("dpo", "ipo")

    @property
    def scale(self) -> float:
        """``beta``, or the loss's default."""
        return float(self.beta) if self.beta is not None else DEFAULT_BETA.get(self.loss, 0.1)
