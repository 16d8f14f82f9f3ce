"""Qwen 2 as a LightningModule."""

from dataclasses import dataclass, field

from titan_lightning.config import JobConfig
from titan_lightning.models.causal_lm import CausalLMModule
from titan_lightning.models.qwen2.model import Qwen2Args
from titan_lightning.models.qwen2.state_dict_adapter import Qwen2StateDictAdapter


@dataclass(kw_only=True)
class Qwen2Job(JobConfig):
    model: Qwen2Args = field(default_factory=Qwen2Args)


class Qwen2Module(CausalLMModule):
    """Qwen 2 / 2.5 (GQA with q/k/v biases, RoPE, SwiGLU)."""

    job: Qwen2Job
    hf_adapter = Qwen2StateDictAdapter
