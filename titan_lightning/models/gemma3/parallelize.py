"""The tensor-parallel plan of the Gemma 3 Transformer, as data: Qwen 3's dense plan
(models/qwen3/parallelize.py: QK-norm as ``head_norm``) plus the two norms after attention and
after the feed-forward. They sit on the residual stream like the pre-norms: ``post_norm`` is the
``norm`` style (sequence-parallel on the rowwise projection's sequence shard, replicated without
sequence parallelism) returning a local tensor, as the projection before it does, for the
residual add. The GeGLU is the SwiGLU's three projections; the soft cap of the logits is
elementwise, so each rank caps its vocab shard (models/common/decoder.py ``Head``).
"""

from titan_lightning.models.common.attention import ATTENTION_TP_PLAN
from titan_lightning.models.common.decoder import decoder_tp_plan

TP_PLAN: dict[str, str] = decoder_tp_plan(
    {**ATTENTION_TP_PLAN, "q_norm": "head_norm", "k_norm": "head_norm"},
    {"layers.*.post_attention_norm": "post_norm", "layers.*.post_ffn_norm": "post_norm"},
)
