"""DeepSeek V3 as a LightningModule."""

from dataclasses import dataclass, field

from titan_lightning.config import JobConfig
from titan_lightning.models.causal_lm import CausalLMModule
from titan_lightning.models.deepseek_v3.model import DeepSeekV3Args
from titan_lightning.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter


@dataclass(kw_only=True)
class DeepSeekV3Job(JobConfig):
    model: DeepSeekV3Args = field(default_factory=DeepSeekV3Args)


class DeepSeekV3Module(CausalLMModule):
    """DeepSeek V3 (multi-head latent attention, YaRN RoPE, MoE with shared experts)."""

    job: DeepSeekV3Job
    hf_adapter = DeepSeekV3StateDictAdapter
