"""Runs the `models` integration suite trains: one small run per model family, and the MoE
families on expert-parallel layouts (entries in tests/integration_tests/models.py)."""

import recipes.deepseek_v3 as deepseek_v3
import recipes.gemma3 as gemma3
import recipes.gpt_oss as gpt_oss
import recipes.mistral as mistral
import recipes.olmo2 as olmo2
import recipes.phi3 as phi3
import recipes.qwen2 as qwen2
import recipes.qwen3 as qwen3
from recipes.tests import features
from titan_lightning.models.gpt_oss.model import alternating
from titan_lightning.recipe import Run, on_layout, with_cp


def llama3_debugmodel() -> Run:
    """Llama 3 debug model, one process (the features suite's baseline)."""
    return features.llama3_debugmodel()


def _for_tests(run: Run) -> Run:
    """5 deterministic steps of 4 sequences of 128 tokens, nothing written: quick on 2 CPU cores."""
    t = run.job.training
    t.seq_len, t.tokens_per_microbatch_per_dp_rank, t.deterministic, t.seed = 128, 512, True, 0
    run.job.lr_schedule.warmup_steps = 1
    run.trainer.update(
        max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    return run


def qwen3_debugmodel() -> Run:
    return _for_tests(qwen3.debugmodel())


def qwen3_moe_debugmodel() -> Run:
    """The MoE debug model cut to 4 layers of 16 experts, top-4: routing, uneven all-to-all splits and
    every layout as before, 4.5x quicker on CPU (64 experts top-8 over 8 layers: 4.2 s a step)."""
    run = _for_tests(qwen3.debugmodel_moe())
    model = run.job.model
    model.n_layers, model.moe.num_experts, model.moe.top_k = 4, 16, 4
    return run


def deepseek_v3_debugmodel() -> Run:
    """The DeepSeek V3 debug model cut to 3 layers: the dense first layer and two MoE layers (MLA,
    8 routed + 2 shared experts), every layout as before at half the time."""
    run = _for_tests(deepseek_v3.debugmodel())
    run.job.model.n_layers = 3
    return run


def qwen3_moe_fsdp2_ep2() -> Run:
    return on_layout(qwen3_moe_debugmodel(), dp_shard=2, ep=2)


def qwen3_moe_fsdp2_tp2_cp2_ep8() -> Run:
    """The front-page layout (recipes.qwen3:fsdp2_tp2_cp2_ep8) on the test budget."""
    return with_cp(qwen3_moe_debugmodel(), "allgather", cp=2, dp_shard=2, tp=2, ep=8)


def deepseek_v3_fsdp2_ep2() -> Run:
    return on_layout(deepseek_v3_debugmodel(), dp_shard=2, ep=2)


def deepseek_v3_fsdp2_ep2_padded() -> Run:
    """EP2 with no host read on the token path: padded all-to-all blocks, and the grouped GEMM
    (torch's CPU kernel) over expert groups padded to 8 rows."""
    run = on_layout(deepseek_v3_debugmodel(), dp_shard=2, ep=2)
    run.job.parallelism.ep_dispatch = "padded"
    run.job.model.moe.use_grouped_mm, run.job.model.moe.token_group_align = True, 8
    return run


def qwen3_moe_debugmodel_bf16_grouped() -> Run:
    """The MoE debug model computing in bf16 (autocast over fp32 parameters) on the grouped GEMM, 2 of
    its 4 layers (bf16 matmuls are slow on a CPU without bf16 units: the compiled entry on them took 63 s)."""
    run = qwen3_moe_debugmodel()
    run.job.model.n_layers = 2
    run.job.training.mixed_precision_param = "bfloat16"
    run.job.model.moe.use_grouped_mm, run.job.model.moe.token_group_align = True, 8
    return run


def qwen3_moe_fsdp2_compiled() -> Run:
    """FSDP2 (experts sharded with their blocks, no EP, bf16 compute) with compile on (aot_eager on
    CPU) and per-op activation checkpointing: each MoE block compiled whole (compile.components'
    default 'moe': on the grouped GEMM its token path reads nothing on the host), its token
    counting kept out of the checkpoint's recompute."""
    run = on_layout(qwen3_moe_debugmodel_bf16_grouped(), dp_shard=2)
    run.job.compile.enable, run.job.compile.backend = True, "aot_eager"
    run.job.activation_checkpoint.mode, run.job.activation_checkpoint.selective_ac_option = "selective", "op"
    return run


def deepseek_v3_fsdp4_ep4() -> Run:
    return on_layout(deepseek_v3_debugmodel(), dp_shard=4, ep=4)


def deepseek_v3_tp2_ep2() -> Run:
    """TP2 (sequence parallel, MLA heads split) x EP2 over the same 2 ranks."""
    return on_layout(deepseek_v3_debugmodel(), dp_shard=1, tp=2, ep=2)


def deepseek_v3_fsdp4_ep2() -> Run:
    """Experts over 2 ranks, FSDP-sharded over the other 2 (efsdp=2)."""
    return on_layout(deepseek_v3_debugmodel(), dp_shard=4, ep=2)


def deepseek_v3_hsdp2_fsdp2_ep2() -> Run:
    """HSDP + EP: two replicas of fsdp2_ep2, the experts replicated across them."""
    return on_layout(deepseek_v3_debugmodel(), dp_replicate=2, dp_shard=2, ep=2)


def qwen3_moe_tp2() -> Run:
    """Tensor-parallel experts (ep=1): each TP rank holds half of every expert's hidden dim."""
    return on_layout(qwen3_moe_debugmodel(), dp_shard=1, tp=2)


def deepseek_v3_fsdp2_tp2() -> Run:
    """FSDP2 x TP2, the routed experts tensor-parallel (ep=1), shared experts per token."""
    return on_layout(deepseek_v3_debugmodel(), dp_shard=2, tp=2)


def qwen3_moe_pp2_fsdp2_ep2() -> Run:
    """Pipeline x experts: 2 stages (1F1B, 2 microbatches), each FSDP2 with its experts over EP2 (4 ranks)."""
    return on_layout(qwen3_moe_debugmodel(), pp=2, dp_shard=2, ep=2, pp_microbatches=2)


def deepseek_v3_pp2_ep2() -> Run:
    """DeepSeek V3 on 2 stages (the dense first layer in stage 0), experts over EP2 within each (4 ranks)."""
    return on_layout(deepseek_v3_debugmodel(), pp=2, dp_shard=2, ep=2, pp_microbatches=2)


def _two_layers(run: Run) -> Run:
    """A debug model on the test budget, cut to 2 layers."""
    run = _for_tests(run)
    run.job.model.n_layers = 2
    return run


def qwen2_debugmodel() -> Run:
    """The Qwen 2 debug model (q/k/v biases), one process."""
    return _two_layers(qwen2.debugmodel())


def qwen2_fsdp2() -> Run:
    return on_layout(qwen2_debugmodel(), dp_shard=2)


def qwen2_tp2() -> Run:
    """TP2 (sequence parallel): each rank holds the q/k/v biases of its own heads."""
    return on_layout(qwen2_debugmodel(), dp_shard=1, tp=2)


def mistral_debugmodel() -> Run:
    """The Mistral debug model, one process."""
    return _two_layers(mistral.debugmodel())


def mistral_fsdp2() -> Run:
    return on_layout(mistral_debugmodel(), dp_shard=2)


def gemma3_debugmodel() -> Run:
    """The Gemma 3 debug model cut to a sliding layer (window 64 of the 128 tokens) and a global one,
    final logits soft-capped at 3 (no release sets it: here the cap bends them), one process."""
    run = _two_layers(gemma3.debugmodel())
    run.job.model.layer_types = ["sliding_attention", "full_attention"]
    run.job.model.final_logit_softcapping = 3.0
    return run


def gemma3_tp2() -> Run:
    """TP2 (sequence parallel): the norms after attention and the feed-forward on the sequence shard,
    QK-norm on each rank's heads, each rank capping its vocab shard of the logits."""
    return on_layout(gemma3_debugmodel(), dp_shard=1, tp=2)


def gemma3_cp2() -> Run:
    """CP2, all-gather K/V: the sliding layer's window (64) reaches across the two ranks' halves of the
    128 tokens, the scores scaled by query_pre_attn_scalar ** -0.5 on every rank."""
    return with_cp(gemma3_debugmodel(), "allgather", cp=2, dp_shard=1)


def mixtral_debugmodel() -> Run:
    """The Mixtral-shaped debug model (8 experts, top-2), one process."""
    return _two_layers(mistral.debugmodel_moe())


def mixtral_fsdp2_ep2() -> Run:
    return on_layout(mixtral_debugmodel(), dp_shard=2, ep=2)


def gpt_oss_debugmodel() -> Run:
    """The gpt-oss debug model cut to 2 layers, one sliding (32 of 128 tokens) and one full: sinks,
    YaRN, 8 experts with biases and the clamped SwiGLU, top-2; one process."""
    run = _two_layers(gpt_oss.debugmodel())
    run.job.model.layer_types = alternating(2)
    return run


def gpt_oss_fsdp2_ep2() -> Run:
    """FSDP2, the experts and their biases over EP2."""
    return on_layout(gpt_oss_debugmodel(), dp_shard=2, ep=2)
def phi3_debugmodel() -> Run:
    """The Phi-3 debug model (RoPE on 12 of 16 features) with a 64-token sliding window of the 128, one process."""
    run = _two_layers(phi3.debugmodel())
    run.job.model.sliding_window = 64
    return run


def phi3_tp2() -> Run:
    """TP2 (sequence parallel): whole heads per rank, each turned on its first 12 features."""
    return on_layout(phi3_debugmodel(), dp_shard=1, tp=2)


def phi3_lora() -> Run:
    """LoRA on every linear of the Phi-3 debug model, one process: the fused q/k/v and gate/up each
    take one adapter, as PEFT's on qkv_proj and gate_up_proj (an A shared by the parts)."""
    from titan_lightning.config.lora import LoRAConfig

    run = phi3_debugmodel()
    run.job.lora = LoRAConfig(rank=4, alpha=8.0)
    run.trainer["max_steps"] = 3
    return run


def phi3_lora_fsdp2() -> Run:
    """FSDP2: each shared A sharded once with its layer."""
    return on_layout(phi3_lora(), dp_shard=2)


def phi3_lora_tp2() -> Run:
    """TP2 (sequence parallel): the shared A replicated under the q, k and v colwise projections, each B split with
    its base's rows."""
    return on_layout(phi3_lora(), dp_shard=1, tp=2)


def olmo2_debugmodel() -> Run:
    """The OLMo 2 debug model (post-norm blocks, QK-norm over whole projections), one process."""
    return _two_layers(olmo2.debugmodel())


def olmo2_tp2() -> Run:
    """TP2 (sequence parallel): each rank's q/k features normalized by the squares of both ranks'."""
    return on_layout(olmo2_debugmodel(), dp_shard=1, tp=2)


# Supervised fine-tuning of the MoE (data.sft): tokens routed to experts of other ranks, the loss over
# the step's supervised tokens (recipes/tests/features.py's SFT entries hold the dense layouts).
def qwen3_moe_sft() -> Run:
    """One process: the seed of the MoE SFT layouts."""
    return features._sft(qwen3_moe_debugmodel())


def qwen3_moe_sft_fsdp2_ep2() -> Run:
    return features._sft(qwen3_moe_fsdp2_ep2())


# LoRA on the routed experts (lora.target_parameters, PEFT's): the Qwen 3 MoE debug model cut to 2
# layers of 8 experts, top-2, on 4 sequences of 64 tokens for 3 steps; adapters on every linear and
# on both expert tensors. EP2 reproduces the one-process run (the factors sharded with the experts).
def qwen3_moe_lora() -> Run:
    """One process: the seed of the expert-adapter layouts."""
    from titan_lightning.config.lora import LoRAConfig

    run = qwen3_moe_debugmodel()
    model, training = run.job.model, run.job.training
    model.n_layers, model.moe.num_experts, model.moe.top_k = 2, 8, 2
    training.seq_len, training.tokens_per_microbatch_per_dp_rank = 64, 256
    run.job.lora = LoRAConfig(rank=4, alpha=8.0, target_parameters=["gate_up_proj", "down_proj"])
    run.trainer["max_steps"] = 3
    return run


def qwen3_moe_lora_fsdp2_ep2() -> Run:
    return on_layout(qwen3_moe_lora(), dp_shard=2, ep=2)


def qwen3_moe_lora_tp2_ep2() -> Run:
    """TP2 (sequence parallel) for attention and its adapters, the experts and theirs over EP2, on 2 ranks."""
    return on_layout(qwen3_moe_lora(), dp_shard=1, tp=2, ep=2)
