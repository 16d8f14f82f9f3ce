from titan_lightning.models.common import RopeScaling
from titan_lightning.models.llama3.model import Llama3Args, Transformer
from titan_lightning.models.llama3.module import Llama3Job, Llama3Module
from titan_lightning.models.llama3.presets import LLAMA3_PRESETS, llama3_args
from titan_lightning.models.llama3.state_dict_adapter import Llama3StateDictAdapter

__all__ = [
    "LLAMA3_PRESETS",
    "Llama3Args",
    "Llama3Job",
    "Llama3Module",
    "Llama3StateDictAdapter",
    "RopeScaling",
    "Transformer",
    "llama3_args",
]
