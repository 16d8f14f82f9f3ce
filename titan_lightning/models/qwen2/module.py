"""Qwen 2 as a LightningModule."""

from titan_lightning.models.family import define_family
from titan_lightning.models.qwen2.model import Qwen2Args
from titan_lightning.models.qwen2.state_dict_adapter import Qwen2StateDictAdapter

Qwen2Job, Qwen2Module = define_family(
    "Qwen2", Qwen2Args, Qwen2StateDictAdapter, module=__name__,
    doc="Qwen 2 / 2.5 (GQA with q/k/v biases, RoPE, SwiGLU).",
)
