"""Low-rank adapters (LoRA): the layer (``layer``), the routed experts' (``experts``), which linears
take them (``targets``), what a run may combine them with (``rules``, ``parallel``), their PEFT
adapter folder and merged export (``export``)."""

from titan_lightning.lora.experts import add_expert_adapters, expert_adapters
from titan_lightning.lora.layer import (LoRALinear, adapters_off, add_adapters, base_only, has_adapters, lora_layers,
                                        merged_weight, quantize_base_nf4, store_frozen_in)
from titan_lightning.lora.rules import check_lora_job
from titan_lightning.lora.targets import add_job_adapters, hf_linears, lora_targets

__all__ = ["LoRALinear", "adapters_off", "add_adapters", "add_expert_adapters", "add_job_adapters", "base_only", "check_lora_job",
           "expert_adapters", "has_adapters", "hf_linears", "lora_layers", "lora_targets", "merged_weight",
           "quantize_base_nf4", "store_frozen_in"]
