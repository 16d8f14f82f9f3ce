from titan_lightning.models.qwen2.model import Qwen2Args, Transformer
from titan_lightning.models.qwen2.module import Qwen2Job, Qwen2Module
from titan_lightning.models.qwen2.presets import QWEN2_PRESETS, qwen2_args
from titan_lightning.models.qwen2.state_dict_adapter import Qwen2StateDictAdapter

__all__ = [
    "QWEN2_PRESETS",
    "Qwen2Args",
    "Qwen2Job",
    "Qwen2Module",
    "Qwen2StateDictAdapter",
    "Transformer",
    "qwen2_args",
]
