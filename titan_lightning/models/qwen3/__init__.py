from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.qwen3.model import Qwen3Args, Transformer
from titan_lightning.models.qwen3.module import Qwen3Job, Qwen3Module
from titan_lightning.models.qwen3.presets import QWEN3_PRESETS, qwen3_args
from titan_lightning.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

__all__ = [
    "MoEArgs",
    "QWEN3_PRESETS",
    "Qwen3Args",
    "Qwen3Job",
    "Qwen3Module",
    "Qwen3StateDictAdapter",
    "Transformer",
    "qwen3_args",
]
