"""DeepSeek V3 as a LightningModule."""

from titan_lightning.models.deepseek_v3.model import DeepSeekV3Args
from titan_lightning.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from titan_lightning.models.family import define_family

DeepSeekV3Job, DeepSeekV3Module = define_family(
    "DeepSeekV3", DeepSeekV3Args, DeepSeekV3StateDictAdapter, module=__name__,
    doc="DeepSeek V3 (multi-head latent attention, YaRN RoPE, MoE with shared experts).",
)
