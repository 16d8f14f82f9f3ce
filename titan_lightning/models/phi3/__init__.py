from titan_lightning.models.phi3.model import LongRope, Phi3Args, Transformer
from titan_lightning.models.phi3.module import Phi3Job, Phi3Module
from titan_lightning.models.phi3.presets import PHI3_PRESETS, phi3_args
from titan_lightning.models.phi3.state_dict_adapter import Phi3StateDictAdapter

__all__ = [
    "PHI3_PRESETS",
    "LongRope",
    "Phi3Args",
    "Phi3Job",
    "Phi3Module",
    "Phi3StateDictAdapter",
    "Transformer",
    "phi3_args",
]
