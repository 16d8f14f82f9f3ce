"""Phi-3 / Phi-4 as a LightningModule."""

from titan_lightning.models.family import define_family
from titan_lightning.models.phi3.model import Phi3Args
from titan_lightning.models.phi3.state_dict_adapter import Phi3StateDictAdapter

Phi3Job, Phi3Module = define_family(
    "Phi3", Phi3Args, Phi3StateDictAdapter, module=__name__,
    doc="Phi-3 / Phi-4 (GQA, RoPE with LongRoPE and partial rotation, SwiGLU).",
)
