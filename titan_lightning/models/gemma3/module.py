"""Gemma 3 (text) as a LightningModule."""

from titan_lightning.models.family import define_family
from titan_lightning.models.gemma3.model import Gemma3Args
from titan_lightning.models.gemma3.state_dict_adapter import Gemma3StateDictAdapter

Gemma3Job, Gemma3Module = define_family(
    "Gemma3", Gemma3Args, Gemma3StateDictAdapter, module=__name__,
    doc="Gemma 3 text (GQA with QK-norm, sliding and global layers, four (1 + w) norms per block, GeGLU).",
)
