"""Llama 3 as a LightningModule."""

from dataclasses import dataclass, field

from titan_lightning.config import JobConfig
from titan_lightning.models.causal_lm import CausalLMModule
from titan_lightning.models.llama3.model import Llama3Args, Transformer, count_parameters
from titan_lightning.models.llama3.parallelize import TP_PLAN
from titan_lightning.models.llama3.state_dict_adapter import Llama3StateDictAdapter


@dataclass(kw_only=True)
class Llama3Job(JobConfig):
    model: Llama3Args = field(default_factory=Llama3Args)


class Llama3Module(CausalLMModule):
    """Llama 3 (dense, GQA, RoPE with Llama-3 frequency scaling, SwiGLU)."""

    job: Llama3Job
    tp_plan = {f"model.{name}": style for name, style in TP_PLAN.items()}

    def build_model(self) -> Transformer:
        return Transformer(self.job.model)

    def state_dict_adapter(self) -> Llama3StateDictAdapter:
        return Llama3StateDictAdapter(self.job.model)

    def _flop_terms(self) -> tuple[int, int]:
        a = self.job.model
        return count_parameters(a) - a.vocab_size * a.dim, a.n_layers * a.n_heads * 2 * a.head_dim
