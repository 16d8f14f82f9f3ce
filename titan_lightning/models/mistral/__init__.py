from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.mistral.model import MistralArgs, Transformer
from titan_lightning.models.mistral.module import MistralJob, MistralModule
from titan_lightning.models.mistral.presets import MISTRAL_PRESETS, mistral_args
from titan_lightning.models.mistral.state_dict_adapter import MistralStateDictAdapter

__all__ = [
    "MISTRAL_PRESETS",
    "MistralArgs",
    "MistralJob",
    "MistralModule",
    "MistralStateDictAdapter",
    "MoEArgs",
    "Transformer",
    "mistral_args",
]
