from titan_lightning.models.gemma3.model import Gemma3Args, Transformer, gemma3_layer_types
from titan_lightning.models.gemma3.module import Gemma3Job, Gemma3Module
from titan_lightning.models.gemma3.presets import GEMMA3_PRESETS, gemma3_args
from titan_lightning.models.gemma3.state_dict_adapter import Gemma3StateDictAdapter

__all__ = [
    "GEMMA3_PRESETS",
    "Gemma3Args",
    "Gemma3Job",
    "Gemma3Module",
    "Gemma3StateDictAdapter",
    "Transformer",
    "gemma3_args",
    "gemma3_layer_types",
]
