"""The tensor-parallel plan of the Mistral / Mixtral Transformer, as data: Llama 3's
(models/llama3/parallelize.py) plus, for Mixtral's MoE blocks (``layers.*.moe``), models/common/moe.py's
MOE_TP_PLAN: each TP rank routes its own sequence shard, the routed experts are expert-parallel.
"""

from titan_lightning.models.common.attention import ATTENTION_TP_PLAN
from titan_lightning.models.common.decoder import decoder_tp_plan
from titan_lightning.models.common.moe import MOE_TP_PLAN

TP_PLAN: dict[str, str] = decoder_tp_plan(ATTENTION_TP_PLAN, MOE_TP_PLAN)
