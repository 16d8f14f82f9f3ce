"""Llama 3 as a LightningModule."""

from titan_lightning.models.family import define_family
from titan_lightning.models.llama3.model import Llama3Args
from titan_lightning.models.llama3.state_dict_adapter import Llama3StateDictAdapter

Llama3Job, Llama3Module = define_family(
    "Llama3", Llama3Args, Llama3StateDictAdapter, module=__name__,
    doc="Llama 3 (dense, GQA, RoPE with Llama-3 frequency scaling, SwiGLU).",
)
