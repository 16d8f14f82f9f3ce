"""Low-rank adapters (LoRA; QLoRA with an NF4 base): ``job.lora``, with PEFT's meaning of each field."""

from dataclasses import dataclass, field
from typing import Optional

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head
BASE_QUANTIZATIONS = ("nf4",)


@dataclass(kw_only=True)
class LoRAConfig:
    """``rank`` 0: no adapters (the whole model trains). Otherwise every target linear gets a
    trainable ``lora_b(lora_a(dropout(x))) * alpha / rank`` added to its frozen output, B starting
    at zero (step 1 computes the base model) and A as PEFT draws it; everything else is frozen."""

    # PEFT's ``r``.
    rank: int = 0
    # PEFT's ``lora_alpha``: the update is scaled by alpha / rank.
    alpha: float = 16.0
    # PEFT's ``lora_dropout``: dropout on the input of A (training only).
    dropout: float = 0.0
    # The linears to adapt, as the model's Hugging Face family names them ("q_proj", "k_proj",
    # "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj" ...), or "all-linear". A comma-separated
    # string is split. Checked against the family's names before launch (titan_lightning/lora/).
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    # None: the frozen base is stored in the compute dtype (training.mixed_precision_param: bf16, no
    # fp32 copy). "nf4": QLoRA, the base linears stored as torchao NF4 and dequantized per forward.
    quantize_base: Optional[str] = None

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            self.target_modules = [name.strip() for name in self.target_modules.split(",") if name.strip()]
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"lora.rank={self.rank!r} must be an integer >= 0 (0: no adapters)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"lora.alpha={self.alpha!r} must be a number > 0 (the update is scaled by alpha / rank)")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout={self.dropout!r} must be a number in [0, 1)")
        if not self.target_modules or not all(isinstance(name, str) for name in self.target_modules):
            raise ValueError(f"lora.target_modules={self.target_modules!r} must name linears (e.g. q_proj,v_proj) "
                             f"or be {ALL_LINEAR}")
        if ALL_LINEAR in self.target_modules and len(self.target_modules) > 1:
            raise ValueError(f"lora.target_modules={','.join(self.target_modules)}: {ALL_LINEAR} already names "
                             f"every linear; give it alone")
        if self.quantize_base is not None and self.quantize_base not in BASE_QUANTIZATIONS:
            raise ValueError(f"lora.quantize_base={self.quantize_base!r} is not one of None, "
                             f"{', '.join(BASE_QUANTIZATIONS)}")
