"""The `models` suite: breadth, each model family trained end to end, the MoE families also on
expert-parallel layouts. Recipes: recipes/tests/models.py. A layout's seed run is its
family's one-process run: under real PG it must reproduce its per-step loss and grad norm
(fp32: 1e-5 / 1e-4; the routing is deterministic, so the same experts are chosen)."""

from titan_lightning.testing.entries import TestEntry

_R = "recipes.tests.models"


def _entry(recipe: str, description: str, ngpu: int = 1, seed: str = None, *, golden: bool = False,
           **kwargs) -> TestEntry:
    return TestEntry(recipes=(f"{_R}:{recipe}",), name=recipe, description=description, ngpu=ngpu,
                     seed_recipe=f"{_R}:{seed}" if seed else None,
                     golden_numerics_path=f"{{execution_mode}}/{{hardware}}/{recipe}.txt" if golden else None,
                     **kwargs)


ENTRIES = [
    _entry("llama3_debugmodel", "Llama 3 debug model, one process"),
    _entry("qwen3_debugmodel", "Qwen 3 dense debug model (QK-norm), one process"),
    _entry("qwen3_moe_debugmodel", "Qwen 3 MoE debug model (4 layers of 16 experts, top-4), one process"),
    _entry("deepseek_v3_debugmodel", "DeepSeek V3 debug model (3 layers: MLA, 8 routed + 2 shared experts), one process"),
    _entry("qwen3_moe_fsdp2_ep2", "Qwen 3 MoE: FSDP2, experts over EP2", 2, "qwen3_moe_debugmodel", golden=True),
    _entry("qwen3_moe_fsdp2_tp2_cp2_ep8", "Qwen 3 MoE: FSDP2 x TP2 x CP2 dense, EP8 experts", 8,
           "qwen3_moe_debugmodel"),
    _entry("deepseek_v3_fsdp2_ep2", "DeepSeek V3: FSDP2, experts over EP2", 2, "deepseek_v3_debugmodel", golden=True),
    _entry("deepseek_v3_fsdp2_ep2_padded", "DeepSeek V3: FSDP2, EP2 without host reads (padded all-to-all, "
           "grouped GEMM over 8-row groups)", 2, "deepseek_v3_debugmodel"),
    # bf16 compute (FSDP's bf16 parameters against one process's autocast): the llama3_fsdp2_tp2_bf16 bounds.
    _entry("qwen3_moe_fsdp2_compiled", "Qwen 3 MoE: FSDP2, MoE blocks compiled whole (aot_eager, grouped GEMM, "
           "bf16) under per-op activation checkpointing", 2, "qwen3_moe_debugmodel_bf16_grouped",
           loss_rtol=1e-2, grad_norm_rtol=5e-2, use_real_pg=True),  # (real lane only: compiling on CPU is its cost)
    _entry("deepseek_v3_tp2_ep2", "DeepSeek V3: TP2 (MLA heads) x EP2", 2, "deepseek_v3_debugmodel"),
    _entry("deepseek_v3_fsdp2_tp2", "DeepSeek V3: FSDP2 x TP2, tensor-parallel experts (ep=1)", 4,
           "deepseek_v3_debugmodel"),
    _entry("deepseek_v3_fsdp4_ep4", "DeepSeek V3: FSDP4, experts over EP4 (2 each)", 4, "deepseek_v3_debugmodel"),
    _entry("deepseek_v3_fsdp4_ep2", "DeepSeek V3: FSDP4, experts over EP2 x efsdp2", 4, "deepseek_v3_debugmodel"),
    _entry("deepseek_v3_hsdp2_fsdp2_ep2", "DeepSeek V3: HSDP 2x2, experts over EP2", 4, "deepseek_v3_debugmodel"),
    _entry("qwen2_fsdp2", "Qwen 2 debug model (q/k/v biases): FSDP2", 2, "qwen2_debugmodel"),
    _entry("qwen2_tp2", "Qwen 2 debug model: TP2, the q/k/v biases split with their heads", 2, "qwen2_debugmodel"),
    _entry("mistral_fsdp2", "Mistral debug model: FSDP2", 2, "mistral_debugmodel"),
    _entry("gemma3_tp2", "Gemma 3 debug model (a sliding and a global layer, soft-capped logits): TP2, the four "
           "norms of a block sequence-parallel", 2, "gemma3_debugmodel", golden=True),
    _entry("gemma3_cp2", "Gemma 3 debug model: CP2 all-gather, a sliding window across the ranks' halves", 2,
           "gemma3_debugmodel"),
    _entry("mixtral_fsdp2_ep2", "Mixtral-shaped debug model (8 experts, top-2): FSDP2, experts over EP2", 2,
           "mixtral_debugmodel"),
    _entry("gpt_oss_fsdp2_ep2", "gpt-oss debug model (sinks, sliding + full layers, YaRN, 8 experts with biases, "
           "clamped SwiGLU): FSDP2, experts over EP2", 2, "gpt_oss_debugmodel", golden=True),
    _entry("phi3_tp2", "Phi-3 debug model (partial RoPE, sliding window): TP2 on whole heads", 2, "phi3_debugmodel",
           golden=True),
    _entry("phi3_lora_fsdp2", "Phi-3 LoRA, one adapter per fused qkv_proj / gate_up_proj (A shared by the parts): "
           "FSDP2", 2, "phi3_lora", golden=True),
    _entry("phi3_lora_tp2", "Phi-3 LoRA: TP2, the shared A replicated, each part's B split with its rows", 2,
           "phi3_lora"),
    _entry("olmo2_tp2", "OLMo 2 debug model (post-norms): TP2, QK-norm over both ranks' heads", 2, "olmo2_debugmodel",
           golden=True),
    _entry("qwen3_moe_pp2_fsdp2_ep2", "Qwen 3 MoE: PP2 x FSDP2, experts over EP2 in each stage", 4,
           "qwen3_moe_debugmodel", golden=True, use_real_pg=True),
    _entry("qwen3_moe_sft_fsdp2_ep2", "Qwen 3 MoE SFT: FSDP2, experts over EP2", 2, "qwen3_moe_sft"),
    _entry("qwen3_moe_lora_fsdp2_ep2", "Qwen 3 MoE LoRA on every linear and on the routed experts (per-expert "
           "factors): FSDP2, experts and their adapters over EP2", 2, "qwen3_moe_lora", golden=True),
    _entry("qwen3_moe_lora_tp2_ep2", "Qwen 3 MoE LoRA: TP2 for attention and its adapters, the experts and theirs "
           "over EP2", 2, "qwen3_moe_lora"),
]
