"""LoRA at every layout: which parallelisms a run with adapters may combine, and how each holds them.

- FSDP2 (dp_shard), HSDP, DDP: the adapters are parameters of their layer, sharded or replicated
  with it; only they train, so only their gradients are reduced.
- TP (+SP): ``lora_a`` / ``lora_b`` are children of their ``LoRALinear``; a colwise base splits B on
  its rows (the update is split like the base's output, A replicated), a rowwise base splits A on
  its columns (the update's partial sums are reduced with the base's, B replicated): the style
  records of parallel/tensor_styles.py. A fused projection (``colwise_fused``) takes no adapters.
- PP: the adapters live in their layer, so in its stage; an adapter-only checkpoint is every
  stage's adapters.
- EP: the routed experts' adapters (lora/experts.py) are stacked per expert like the experts'
  weights and sharded with them on the expert dim.
- CP and gradient accumulation: nothing of the adapters' own (the layout is the activations').
"""

from typing import Any

from torch import nn

from titan_lightning.config import ConfigError


def check_lora_layout(job: Any, model: nn.Module) -> None:
    """One-line ConfigError for a layout adapters do not compose with, before launch; ``model``:
    the job's model on the meta device."""
    lora, p = job.lora, job.parallelism
    for name in ("ep",):
        if getattr(p, name) > 1:
            raise ConfigError(f"lora.rank={lora.rank} with parallelism.{name}={getattr(p, name)}: adapters compose "
                              f"with dp_shard, dp_replicate, cp and pp for now; set parallelism.{name}=1")
