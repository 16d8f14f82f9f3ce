"""OLMo 2 as a LightningModule."""

from titan_lightning.models.family import define_family
from titan_lightning.models.olmo2.model import Olmo2Args
from titan_lightning.models.olmo2.state_dict_adapter import Olmo2StateDictAdapter

Olmo2Job, Olmo2Module = define_family(
    "Olmo2", Olmo2Args, Olmo2StateDictAdapter, module=__name__,
    doc="OLMo 2 (post-norm blocks, QK-norm over whole projections, GQA, RoPE, SwiGLU).",
)
