"""Mistral / Mixtral as a LightningModule."""

from titan_lightning.models.family import define_family
from titan_lightning.models.mistral.model import MistralArgs
from titan_lightning.models.mistral.state_dict_adapter import MistralStateDictAdapter

MistralJob, MistralModule = define_family(
    "Mistral", MistralArgs, MistralStateDictAdapter, module=__name__,
    doc="Mistral (GQA, RoPE, SwiGLU) and Mixtral (top-2 of 8 SwiGLU experts).",
)
