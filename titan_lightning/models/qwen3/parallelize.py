"""The tensor-parallel plan of the Qwen 3 Transformer, as data.

The Llama 3 plan (models/llama3/parallelize.py: embeddings, norms, attention, dense SwiGLU,
output; the module names are the same) plus QK-norm:

    q_norm, k_norm     head_norm: the [head_dim] weight replicated, the input q/k
                       [B, S, local heads, head_dim] sharded on the heads (dim 2), so the
                       weight's gradient is summed over the TP ranks' heads

``head_norm`` is torch's ``SequenceParallel(sequence_dim=2, use_local_output=True)`` whether
or not sequence parallelism is on; ``titan_lightning.parallel.tensor`` turns the style names
into torch ParallelStyles. MoE blocks (``layers.*.moe``; their ``feed_forward`` slot is None,
which the plan skips) take models/common/moe.py's MOE_TP_PLAN: each TP rank routes its own
sequence shard, and the routed experts are expert-parallel.
"""

from titan_lightning.models.common.attention import ATTENTION_TP_PLAN
from titan_lightning.models.common.decoder import decoder_tp_plan
from titan_lightning.models.common.moe import MOE_TP_PLAN

TP_PLAN: dict[str, str] = decoder_tp_plan({**ATTENTION_TP_PLAN, "q_norm": "head_norm", "k_norm": "head_norm"}, MOE_TP_PLAN)
