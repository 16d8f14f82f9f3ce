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

``titan_lightning.parallel.tensor`` turns the style names into torch ParallelStyles.
"""

TP_PLAN: dict[str, str] = {
    "tok_embeddings": "embedding",
    "layers.*.attention_norm": "norm",
    "layers.*.attention": "prepare_block_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "norm",
    "layers.*.feed_forward": "prepare_block_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.feed_forward.w3": "colwise",
    "norm": "norm",
    "output": "output",
}


def llama3_tp_plan() -> dict[str, str]:
    """A copy of TP_PLAN, safe to edit."""
    return dict(TP_PLAN)
