"""Qwen 3 as a LightningModule."""

from dataclasses import dataclass, field

from titan_lightning.config import JobConfig
from titan_lightning.models.causal_lm import CausalLMModule
from titan_lightning.models.qwen3.model import Qwen3Args, Transformer, count_parameters
from titan_lightning.models.qwen3.parallelize import TP_PLAN
from titan_lightning.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter


@dataclass(kw_only=True)
class Qwen3Job(JobConfig):
    model: Qwen3Args = field(default_factory=Qwen3Args)


class Qwen3Module(CausalLMModule):
    """Qwen 3 (GQA with QK-norm, RoPE, SwiGLU or top-k mixture of experts)."""

    job: Qwen3Job
    tp_plan = {f"model.{name}": style for name, style in TP_PLAN.items()}

    def build_model(self) -> Transformer:
        return Transformer(self.job.model)

    def state_dict_adapter(self) -> Qwen3StateDictAdapter:
        return Qwen3StateDictAdapter(self.job.model)

    def _flop_terms(self) -> tuple[int, int]:
        a = self.job.model
        return count_parameters(a, active=True) - a.vocab_size * a.dim, a.n_layers * a.n_heads * 2 * a.head_dim
