"""DeepSeek V3 as a LightningModule."""

from dataclasses import dataclass, field

from titan_lightning.config import JobConfig
from titan_lightning.models.causal_lm import CausalLMModule
from titan_lightning.models.deepseek_v3.model import DeepSeekV3Args, Transformer, count_parameters
from titan_lightning.models.deepseek_v3.parallelize import deepseek_v3_tp_plan
from titan_lightning.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter


@dataclass(kw_only=True)
class DeepSeekV3Job(JobConfig):
    model: DeepSeekV3Args = field(default_factory=DeepSeekV3Args)


class DeepSeekV3Module(CausalLMModule):
    """DeepSeek V3 (multi-head latent attention, YaRN RoPE, MoE with shared experts)."""

    job: DeepSeekV3Job

    @property
    def tp_plan(self) -> dict[str, str]:
        return {f"model.{name}": style for name, style in deepseek_v3_tp_plan(self.job.model).items()}

    def build_model(self) -> Transformer:
        return Transformer(self.job.model)

    def state_dict_adapter(self) -> DeepSeekV3StateDictAdapter:
        return DeepSeekV3StateDictAdapter(self.job.model)

    def _flop_terms(self) -> tuple[int, int]:
        a = self.job.model  # the active count already leaves out the embedding table
        return count_parameters(a, active=True), a.n_layers * a.n_heads * (a.qk_head_dim + a.v_head_dim)
