"""The tensor-parallel plan of the Phi-3 Transformer, as data: Llama 3's
(models/llama3/parallelize.py). Hugging Face's fused ``qkv_proj`` and ``gate_up_proj`` are split
on load, so wq / wk / wv and w1 / w3 are colwise on whole heads and whole SwiGLU halves.
"""

from titan_lightning.models.common.attention import ATTENTION_TP_PLAN
from titan_lightning.models.common.decoder import decoder_tp_plan

TP_PLAN: dict[str, str] = decoder_tp_plan(ATTENTION_TP_PLAN)
