from titan_lightning.models.olmo2.model import Olmo2Args, ProjectionNorm, Transformer
from titan_lightning.models.olmo2.module import Olmo2Job, Olmo2Module
from titan_lightning.models.olmo2.presets import OLMO2_PRESETS, olmo2_args
from titan_lightning.models.olmo2.state_dict_adapter import Olmo2StateDictAdapter

__all__ = [
    "OLMO2_PRESETS",
    "Olmo2Args",
    "Olmo2Job",
    "Olmo2Module",
    "Olmo2StateDictAdapter",
    "ProjectionNorm",
    "Transformer",
    "olmo2_args",
]
