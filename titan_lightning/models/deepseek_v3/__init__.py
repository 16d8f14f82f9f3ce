from titan_lightning.models.deepseek_v3.model import (
    DeepSeekV3Args,
    MultiHeadLatentAttention,
    Transformer,
    yarn_rope_cache,
)
from titan_lightning.models.deepseek_v3.module import DeepSeekV3Job, DeepSeekV3Module
from titan_lightning.models.deepseek_v3.parallelize import deepseek_v3_tp_plan
from titan_lightning.models.deepseek_v3.presets import DEEPSEEK_V3_PRESETS, deepseek_v3_args

__all__ = [
    "DEEPSEEK_V3_PRESETS",
    "DeepSeekV3Args",
    "DeepSeekV3Job",
    "DeepSeekV3Module",
    "MultiHeadLatentAttention",
    "Transformer",
    "deepseek_v3_args",
    "deepseek_v3_tp_plan",
    "yarn_rope_cache",
]
