"""The tensor-parallel plan of the Llama 3 Transformer, as data.

torchtitan's plan (Megatron-style, with sequence parallelism between blocks):

    tok_embeddings     vocab rows split; hidden states leave sharded on the sequence (SP)
    attention_norm,    run on the local sequence shard (SP)
    ffn_norm, norm
    attention,         all-gather the sequence before the projections (SP)
    feed_forward
    wq wk wv, w1 w3    colwise: each rank holds n_heads/tp query heads, n_kv_heads/tp
                       key/value heads, ffn_hidden_dim/tp SwiGLU features
    wo, w2             rowwise: reduce-scatter back onto the sequence (SP) or all-reduce
    output             colwise over the vocab; vocab-sharded logits with loss parallel

The skeleton's entries are models/common/decoder.py's; ``titan_lightning.parallel.tensor``
turns the style names into torch ParallelStyles.
"""

from titan_lightning.models.common.attention import ATTENTION_TP_PLAN
from titan_lightning.models.common.decoder import decoder_tp_plan

TP_PLAN: dict[str, str] = decoder_tp_plan(ATTENTION_TP_PLAN)
