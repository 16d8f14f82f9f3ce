from titan_lightning.models.gpt_oss.model import GptOssArgs, GptOssYarn, Transformer
from titan_lightning.models.gpt_oss.module import GptOssJob, GptOssModule
from titan_lightning.models.gpt_oss.presets import GPT_OSS_PRESETS, gpt_oss_args
from titan_lightning.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter

__all__ = [
    "GPT_OSS_PRESETS",
    "GptOssArgs",
    "GptOssJob",
    "GptOssModule",
    "GptOssStateDictAdapter",
    "GptOssYarn",
    "Transformer",
    "gpt_oss_args",
]
