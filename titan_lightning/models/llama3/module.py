"""Llama 3 as a LightningModule."""

from dataclasses import dataclass, field

from titan_lightning.config import JobConfig
from titan_lightning.models.causal_lm import CausalLMModule
from titan_lightning.models.llama3.model import Llama3Args
from titan_lightning.models.llama3.state_dict_adapter import Llama3StateDictAdapter


@dataclass(kw_only=True)
class Llama3Job(JobConfig):
    model: Llama3Args = field(default_factory=Llama3Args)


class Llama3Module(CausalLMModule):
    """Llama 3 (dense, GQA, RoPE with Llama-3 frequency scaling, SwiGLU)."""

    job: Llama3Job
    hf_adapter = Llama3StateDictAdapter
