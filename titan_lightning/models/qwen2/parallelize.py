"""The tensor-parallel plan of the Qwen 2 Transformer, as data: Llama 3's
(models/llama3/parallelize.py). The q/k/v biases need no entry of their own: a colwise
projection's bias is split with its output rows, so each rank adds the biases of its own heads.
"""

from titan_lightning.models.common.attention import ATTENTION_TP_PLAN
from titan_lightning.models.common.decoder import decoder_tp_plan

TP_PLAN: dict[str, str] = decoder_tp_plan(ATTENTION_TP_PLAN)
