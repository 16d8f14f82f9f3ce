"""The tensor-parallel plan of the OLMo 2 Transformer, as data. Llama's entries (models/common/
decoder.py) for the embeddings, the attention and SwiGLU projections and the head; the post-norms
run on the sequence shard the row-wise projection before them leaves (sequence parallelism) and
hand the residual add a local tensor (``post_norm``). q_norm and k_norm span every head of their
projection: their weights are split with the projection's rows, and the norm sums its squares
over the ranks (``colwise_norm``).
"""

from titan_lightning.models.common.attention import ATTENTION_TP_PLAN

TP_PLAN: dict[str, str] = {
    "tok_embeddings": "embedding",
    "layers.*.attention": "prepare_block_input",
    **{f"layers.*.attention.{name}": style for name, style in ATTENTION_TP_PLAN.items()},
    "layers.*.attention.q_norm": "colwise_norm",
    "layers.*.attention.k_norm": "colwise_norm",
    "layers.*.post_attention_norm": "post_norm",
    "layers.*.feed_forward": "prepare_block_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.post_ffn_norm": "post_norm",
    "norm": "norm",
    "output": "output",
}
