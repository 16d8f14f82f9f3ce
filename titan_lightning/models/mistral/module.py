"""Mistral / Mixtral as a LightningModule."""

from dataclasses import dataclass, field

from titan_lightning.config import JobConfig
from titan_lightning.models.causal_lm import CausalLMModule
from titan_lightning.models.mistral.model import MistralArgs
from titan_lightning.models.mistral.state_dict_adapter import MistralStateDictAdapter


@dataclass(kw_only=True)
class MistralJob(JobConfig):
    model: MistralArgs = field(default_factory=MistralArgs)


class MistralModule(CausalLMModule):
    """Mistral (GQA, RoPE, SwiGLU) and Mixtral (top-2 of 8 SwiGLU experts)."""

    job: MistralJob
    hf_adapter = MistralStateDictAdapter
