"""gpt-oss as a LightningModule."""

from titan_lightning.models.family import define_family
from titan_lightning.models.gpt_oss.model import GptOssArgs
from titan_lightning.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter

GptOssJob, GptOssModule = define_family(
    "GptOss", GptOssArgs, GptOssStateDictAdapter, module=__name__,
    doc="gpt-oss (GQA with biases and attention sinks, sliding and full layers, YaRN, MoE of clamped SwiGLUs).",
)
