"""Low-rank adapters (LoRA; QLoRA with an NF4 base): ``job.lora``, with PEFT's meaning of each field."""

from dataclasses import dataclass, field
from typing import Optional, Union

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head
BASE_QUANTIZATIONS = ("nf4",)
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # transformers 5's names of the routed experts' tensors


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
    # string is split (``--job.lora.target_modules q_proj,v_proj``). Checked against the family's names
    # before launch (titan_lightning/lora/).
    target_modules: Union[list[str], str] = field(default_factory=lambda: [ALL_LINEAR])
    # PEFT's ``target_parameters``: the routed experts' tensors to adapt, as transformers 5 names them
    # in every MoE layer ("gate_up_proj": the gate and up projections, one adapter over both;
    # "down_proj"); per-expert factors, sharded with the experts under expert parallelism
    # (titan_lightning/lora/experts.py). A comma-separated string is split.
    target_parameters: Union[list[str], str] = field(default_factory=list)
    # None: the frozen base is stored in the compute dtype (training.mixed_precision_param: bf16, no
    # fp32 copy). "nf4": QLoRA, the base linears stored as torchao NF4 and dequantized per forward.
    quantize_base: Optional[str] = None
    # A PEFT adapter folder (adapter_config.json and adapter_model.safetensors, as PEFT, TRL, axolotl
    # or Unsloth save one) whose adapters a fresh run starts from, in place of B zero and A drawn (a
    # resumed run takes its checkpoint's); rank, alpha and targets must be the folder's, checked before
    # launch (titan_lightning/lora/peft_import.py). The base still comes from checkpoint.initial_load_path.
    init_from: Optional[str] = None

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            self.target_modules = [name.strip() for name in self.target_modules.split(",") if name.strip()]
        if isinstance(self.target_parameters, str):
            self.target_parameters = [name.strip() for name in self.target_parameters.split(",") if name.strip()]
        unknown = [name for name in self.target_parameters if name not in EXPERT_PARAMETERS]
        if unknown or len(set(self.target_parameters)) != len(self.target_parameters):
            raise ValueError(f"lora.target_parameters={','.join(map(str, self.target_parameters))}: each of "
                             f"{', '.join(EXPERT_PARAMETERS)} at most once (the routed experts' tensors)")
        if self.target_parameters and self.dropout:
            raise ValueError(f"lora.dropout={self.dropout} with lora.target_parameters: the experts' adapters add "
                             f"to their weights (as PEFT's), which leaves no input to drop out; set lora.dropout=0")
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
        if self.init_from is not None and not self.enabled:
            raise ValueError(f"lora.init_from={self.init_from!r} with lora.rank=0: set lora.rank (and alpha, "
                             f"target_modules) to the adapters' r, lora_alpha and target_modules")
        if self.quantize_base is not None and self.quantize_base not in BASE_QUANTIZATIONS:
            raise ValueError(f"lora.quantize_base={self.quantize_base!r} is not one of None, "
                             f"{', '.join(BASE_QUANTIZATIONS)}")
