"""LoRA at every layout: which parallelisms a run with adapters may combine, and how each holds them.

- FSDP2 (dp_shard), HSDP, DDP: the adapters are parameters of their layer, sharded or replicated
  with it; only they train, so only their gradients are reduced.
- TP (+SP): ``lora_a`` / ``lora_b`` are children of their ``LoRALinear``, and the style of the
  plan's entry places them with the base (``AdaptedLinearParallel``, parallel/tensor_styles.py):
  under colwise (and colwise_fused: B strided like the fused rows) A is replicated and B split on
  its rows, so the update is split like the base's output; under rowwise A is split on its columns,
  its partial sums reduced before B, B replicated; under moe_replicated (a router gate, a shared
  expert) both replicated. Each gradient is placed as its weight. A frozen parameter stays frozen
  (``apply_tp``). The parts of a fused linear (Phi-3's q, k, v) share one A, replicated under
  their colwise styles (placed by the first, kept by the others), each part's B split with its rows.
- PP: the adapters live in their layer, so in its stage; an adapter-only checkpoint is every
  stage's adapters.
- EP: the routed experts' adapters (lora/experts.py) are stacked per expert like the experts'
  weights and sharded with them on the expert dim (parallel/expert.py shards every parameter of
  the experts), FSDP-sharded with them over the expert FSDP ranks. Expert tensor parallelism
  (tp > 1 with ep = 1) does not split them: refused below.
- CP and gradient accumulation: nothing of the adapters' own (the layout is the activations').

Each layout equals one process: the llama3_lora_* (features), qwen3_moe_lora_* and phi3_lora_* (models) entries.
"""

from typing import Any

from torch import nn

from titan_lightning.config import ConfigError
from titan_lightning.lora.experts import routed_experts


def check_lora_layout(job: Any, model: nn.Module) -> None:
    """One-line ConfigError for a layout adapters do not compose with, before launch; ``model``:
    the job's model on the meta device."""
    lora, p = job.lora, job.parallelism
    if not lora.target_parameters:
        return
    if not routed_experts(model):
        raise ConfigError(f"lora.target_parameters={','.join(lora.target_parameters)}: {type(model).__name__} has "
                          f"no routed experts (no MoE layer); leave lora.target_parameters empty")
    if p.tp > 1 and p.ep == 1:
        raise ConfigError(f"lora.target_parameters={','.join(lora.target_parameters)} with parallelism.tp={p.tp} and "
                          f"ep=1: the experts' adapters are not split over their hidden dim (expert tensor "
                          f"parallelism); set parallelism.ep to a multiple of tp, or leave target_parameters empty")
