"""Qwen 3 as a LightningModule."""

from titan_lightning.models.family import define_family
from titan_lightning.models.qwen3.model import Qwen3Args
from titan_lightning.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

Qwen3Job, Qwen3Module = define_family(
    "Qwen3", Qwen3Args, Qwen3StateDictAdapter, module=__name__,
    doc="Qwen 3 (GQA with QK-norm, RoPE, SwiGLU or top-k mixture of experts).",
)
