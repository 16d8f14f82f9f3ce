"""Qwen 3 as a LightningModule."""

from dataclasses import dataclass, field

from titan_lightning.config import JobConfig
from titan_lightning.models.causal_lm import CausalLMModule
from titan_lightning.models.qwen3.model import Qwen3Args
from titan_lightning.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter


@dataclass(kw_only=True)
class Qwen3Job(JobConfig):
    model: Qwen3Args = field(default_factory=Qwen3Args)


class Qwen3Module(CausalLMModule):
    """Qwen 3 (GQA with QK-norm, RoPE, SwiGLU or top-k mixture of experts)."""

    job: Qwen3Job
    hf_adapter = Qwen3StateDictAdapter
