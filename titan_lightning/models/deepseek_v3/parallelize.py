"""The tensor-parallel plan of the DeepSeek V3 Transformer, as data.

The decoder skeleton's plan (models/common/decoder.py, as Llama 3's), with MLA's projections:

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

from titan_lightning.models.common.decoder import decoder_tp_plan
from titan_lightning.models.common.moe import MOE_TP_PLAN

_QUERY = {False: {"wq": "colwise"}, True: {"wq_a": "replicate", "q_norm": "replicate", "wq_b": "colwise"}}


def deepseek_v3_tp_plan(args) -> dict[str, str]:
    """Module-name patterns -> style names for DeepSeekV3Args ``args`` (the query projections
    depend on q_lora_rank)."""
    attention = {**_QUERY[args.q_lora_rank > 0], "wkv_a": "replicate", "kv_norm": "replicate",
                 "k_pe_shared": "head_shared", "wkv_b": "colwise", "wo": "rowwise"}
    return decoder_tp_plan(attention, MOE_TP_PLAN)
