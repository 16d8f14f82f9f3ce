"""The tensor-parallel plan of the DeepSeek V3 Transformer, as data.

Like Llama 3's (models/llama3/parallelize.py), with MLA's projections:

    wq, or wq_b        colwise: each rank holds n_heads/tp query heads
    wkv_b              colwise: the same heads' k_nope and v
    wo                 rowwise: reduce-scatter back onto the sequence (SP) or all-reduce
    wq_a, q_norm,      replicated: the latents are small and kv_norm/q_norm need all of
    wkv_a, kv_norm     their features; every rank computes them on the gathered sequence
    k_pe_shared        head_shared: the rotary key serves every head, so its gradient is the
                       sum over all ranks' heads (an all-reduce in the backward)

The ``replicate`` style is ``ReplicateParallel`` whether or not sequence parallelism is on
(the input is the block input that ``prepare_block_input`` already gathered). MoE layers
take models/common/moe.py's MOE_TP_PLAN: each TP rank routes its own sequence shard, the
routed experts are expert-parallel.
"""

from titan_lightning.models.common.moe import MOE_TP_PLAN
from titan_lightning.models.deepseek_v3.model import DeepSeekV3Args

_QUERY = {
    False: {"layers.*.attention.wq": "colwise"},
    True: {
        "layers.*.attention.wq_a": "replicate",
        "layers.*.attention.q_norm": "replicate",
        "layers.*.attention.wq_b": "colwise",
    },
}


def deepseek_v3_tp_plan(args: DeepSeekV3Args) -> dict[str, str]:
    """Module-name patterns -> style names for ``args`` (the query projections depend on q_lora_rank)."""
    return {
        "tok_embeddings": "embedding",
        "layers.*.attention_norm": "norm",
        "layers.*.attention": "prepare_block_input",
        **_QUERY[args.q_lora_rank > 0],
        "layers.*.attention.wkv_a": "replicate",
        "layers.*.attention.kv_norm": "replicate",
        "layers.*.attention.k_pe_shared": "head_shared",
        "layers.*.attention.wkv_b": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "norm",
        "layers.*.feed_forward": "prepare_block_input",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "layers.*.feed_forward.w3": "colwise",
        "norm": "norm",
        "output": "output",
        **MOE_TP_PLAN,
    }
