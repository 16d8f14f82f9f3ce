"""The `features` suite: depth, the parallelisms composed on the Llama 3 debug model.

Recipes: recipes/tests/features.py. A parallel layout's seed run is the single-process one:
under real PG it must reproduce its per-step loss and grad norm (fp32: 1e-5 / 1e-4).
Goldens: tests/assets/losses/<execution_mode>/<hardware>/<name>.txt (<hardware>: cpu_amd, cpu_intel, h200, ...).
"""

from titan_lightning.testing.entries import TestEntry

_R = "recipes.tests.features"
_SEED = f"{_R}:llama3_debugmodel"
_GOLDEN = "{execution_mode}/{hardware}/%s.txt"


def _entry(recipe: str, description: str, ngpu: int = 1, *, golden: bool = False, seed: str = _SEED,
           **kwargs) -> TestEntry:
    seed = seed if ngpu > 1 else None  # a parallel layout must reproduce the one-process run
    return TestEntry(
        recipes=(f"{_R}:{recipe}",), name=recipe, description=description, ngpu=ngpu, seed_recipe=seed,
        golden_numerics_path=_GOLDEN % recipe if golden else None, **kwargs,
    )


ENTRIES = [
    _entry("llama3_debugmodel", "one process, fp32, deterministic"),
    _entry("llama3_debugmodel_accumulation", "two microbatches per step from tokens_per_step"),
    _entry("llama3_debugmodel_bf16", "bf16 autocast over fp32 parameters (the small shape)"),
    _entry("llama3_fsdp2", "FSDP2 over 2 ranks", 2),
    _entry("llama3_fsdp4", "FSDP2 over 4 ranks", 4, golden=True),
    _entry("llama3_ddp2", "DDP over 2 ranks", 2),
    _entry("llama3_ddp4", "DDP over 4 ranks", 4),
    _entry("llama3_hsdp2x2", "HSDP: 2 replicas of FSDP2", 4),
    _entry("llama3_tp2", "TP2 with sequence and loss parallel", 2),
    _entry("llama3_tp4", "TP4 with sequence and loss parallel", 4),
    _entry("llama3_tp2_no_sp", "TP2 without sequence parallel", 2),
    _entry("llama3_tp4_no_sp", "TP4 without sequence parallel", 4),
    _entry("llama3_fsdp2_tp2", "FSDP2 x TP2", 4, golden=True),
    _entry("llama3_hsdp2x2_tp2", "2 replicas of FSDP2 x TP2", 8),
    # bf16 compute vs the fp32 seed of the same (small) shape: measured 2.6e-4 (loss) / 1.6e-3 (grad norm) apart.
    _entry("llama3_fsdp2_tp2_bf16", "FSDP2 x TP2, bf16 parameters in compute, fp32 reduce", 4,
           seed=f"{_R}:llama3_small", loss_rtol=1e-2, grad_norm_rtol=5e-2),
    _entry("llama3_fsdp2_ac_full", "FSDP2 with full activation checkpointing", 2),
    _entry("llama3_fsdp2_tp2_ac_op", "FSDP2 x TP2 with per-op selective activation checkpointing", 4),
    _entry("llama3_cp2", "CP2, all-gather K/V, headtail", 2, golden=True),
    _entry("llama3_cp2_ring", "CP2, ring attention", 2),
    _entry("llama3_cp2_ulysses", "CP2, Ulysses all-to-all", 2),
    _entry("llama3_cp4", "CP4, all-gather K/V", 4),
    _entry("llama3_cp4_ring", "CP4, ring attention", 4),
    _entry("llama3_cp4_ulysses", "CP4, Ulysses all-to-all", 4),
    _entry("llama3_fsdp2_cp2", "FSDP2 x CP2", 4),
    _entry("llama3_hsdp2_cp2", "2 replicas of FSDP over CP2", 4),
    _entry("llama3_fsdp2_tp2_cp2", "FSDP2 x TP2 x CP2", 8, golden=True),
    _entry("llama3_debugmodel_block_causal", "one process, document masking (block-causal, per-document RoPE)"),
    _entry("llama3_fsdp2_cp2_block_causal", "FSDP2 x CP2 with document masking", 4, golden=True,
           seed=f"{_R}:llama3_debugmodel_block_causal"),
    # Pipeline parallel: real process groups only (the fake group moves no activations between stages).
    # GPipe runs in llama3_pp2_tp2, a looped BFS order in llama3_pp2_csv; every schedule alone:
    # benchmarks/parity.py --only pp.
    _entry("llama3_pp2", "PP2, 1F1B, 2 microbatches", 2, golden=True, use_real_pg=True),
    _entry("llama3_pp2_fsdp2", "PP2 x FSDP2, each stage sharded", 4, use_real_pg=True),
    _entry("llama3_pp2_tp2", "PP2 x TP2, GPipe", 4, use_real_pg=True),
    _entry("llama3_pp2_fsdp2_tp2", "PP2 x FSDP2 x TP2", 8, golden=True, use_real_pg=True),
    _entry("llama3_pp2_interleaved", "PP2, Interleaved 1F1B, 2 stages per rank", 2, golden=True, use_real_pg=True),
    _entry("llama3_pp2_zero_bubble", "PP2, interleaved zero bubble (split input/weight backward)", 2,
           use_real_pg=True),
    _entry("llama3_pp2_zbv", "PP2, zero bubble with V placement", 2, use_real_pg=True),
    _entry("llama3_pp2_csv", "PP2, a looped schedule read from a CSV file", 2, use_real_pg=True),
    # 2 ranks x 2 accumulated microbatches = the baseline's 4 sequences per step
    _entry("llama3_fsdp2_accumulation", "FSDP2, 2 accumulated microbatches per step", 2,
           loss_rtol=1e-6, grad_norm_rtol=1e-6),
    _entry("llama3_fsdp2_accumulation_last_sync", "FSDP2, 2 microbatches, gradients reduced after the last only", 2,
           loss_rtol=1e-6, grad_norm_rtol=1e-6),
    # torch.compile per block (aot_eager on CPU: the graphs, not the kernels); real PG only to keep
    # CI short: a fake-PG run would trace the same graphs again and cover nothing the real run lacks.
    _entry("llama3_fsdp2_compile_ac", "FSDP2, compiled blocks over per-op selective AC, compiled loss", 2,
           use_real_pg=True),
    _entry("llama3_pp2_fsdp2_compile", "PP2 x FSDP2, compiled blocks and loss", 4, use_real_pg=True),
    # The chunked loss against the plain one (the seed): FSDP x TP with loss parallel, and PP's last stage.
    _entry("llama3_fsdp2_tp2_chunked_loss", "FSDP2 x TP2, head and loss over 3 token chunks (no full logits)", 4),
    _entry("llama3_pp2_chunked_loss", "PP2, the last stage's loss applies the head over 3 token chunks", 2,
           use_real_pg=True),
    _entry("llama3_fsdp2_tp2_compile", "FSDP2 x TP2, each block's children compiled (TP hooks outside)", 4,
           use_real_pg=True),
    # Supervised fine-tuning (data.sft): loss-masked, packed conversations; every layout reproduces the
    # one-process run, whose windows and ranks hold very different numbers of supervised tokens.
    # (The one-process seeds, llama3_sft and models' qwen3_moe_sft, run as the entries' seed runs.)
    TestEntry(recipes=(f"{_R}:llama3_sft_accumulation",), name="llama3_sft_accumulation",
              description="SFT: the same global batch in 2 microbatches", seed_recipe=f"{_R}:llama3_sft"),
    _entry("llama3_sft_fsdp2", "SFT: FSDP2", 2, golden=True, seed=f"{_R}:llama3_sft"),
    _entry("llama3_sft_fsdp2_tp2", "SFT: FSDP2 x TP2 (loss parallel)", 4, seed=f"{_R}:llama3_sft"),
    _entry("llama3_sft_cp2", "SFT: CP2, all-gather K/V", 2, golden=True, seed=f"{_R}:llama3_sft"),
    _entry("llama3_sft_pp2", "SFT: PP2, the last stage's loss", 2, seed=f"{_R}:llama3_sft", use_real_pg=True),
    # LoRA: adapters on every linear, the base frozen; every layout reproduces the one-process LoRA run.
    TestEntry(recipes=(f"{_R}:llama3_lora_accumulation",), name="llama3_lora_accumulation",
              description="LoRA: the same global batch in 2 microbatches", seed_recipe=f"{_R}:llama3_lora"),
    _entry("llama3_lora_fsdp2_accumulation", "LoRA: FSDP2, adapters sharded with their layer, 2 microbatches", 2,
           golden=True, seed=f"{_R}:llama3_lora"),
    _entry("llama3_lora_tp2", "LoRA: TP2 (sequence parallel), A and B split as their base", 2, golden=True,
           seed=f"{_R}:llama3_lora"),
    _entry("llama3_lora_cp2", "LoRA: CP2, all-gather K/V", 2, seed=f"{_R}:llama3_lora"),
    _entry("llama3_lora_cp2_ring", "LoRA: CP2, ring attention", 2, seed=f"{_R}:llama3_lora"),
    _entry("llama3_lora_cp2_ulysses", "LoRA: CP2, Ulysses all-to-all", 2, seed=f"{_R}:llama3_lora"),
    _entry("llama3_lora_pp2", "LoRA: PP2, adapters in their stage", 2, golden=True, seed=f"{_R}:llama3_lora",
           use_real_pg=True),
    # QLoRA: the NF4 base sharded on its rows, each rank's the rows of the one-process quantization.
    _entry("llama3_qlora_fsdp2_accumulation", "QLoRA: FSDP2 over the NF4 base, adapters sharded with it, "
           "2 microbatches", 2, golden=True, seed=f"{_R}:llama3_qlora"),
    # DPO on pairs of very uneven lengths: the loss is the mean over each step's pairs on every layout.
    TestEntry(recipes=(f"{_R}:llama3_dpo_accumulation",), name="llama3_dpo_accumulation",
              description="DPO: the same pairs in 2 microbatches a step", seed_recipe=f"{_R}:llama3_dpo"),
    _entry("llama3_dpo_fsdp2_accumulation", "DPO: FSDP2, 2 microbatches of 1 window per rank", 2, golden=True,
           seed=f"{_R}:llama3_dpo"),
    _entry("llama3_dpo_fsdp2_frozen", "DPO: FSDP2, the reference a frozen copy sharded like the model", 2,
           seed=f"{_R}:llama3_dpo"),
    _entry("llama3_dpo_tp2", "DPO: TP2 (sequence and loss parallel), per-sequence sums of vocab-parallel losses", 2,
           golden=True, seed=f"{_R}:llama3_dpo"),
    _entry("llama3_dpo_cp2_ring", "DPO: CP2, ring attention, each sequence's log-probability summed over cp", 2,
           golden=True, seed=f"{_R}:llama3_dpo"),
    _entry("llama3_dpo_pp2", "DPO: PP2, the pairs' losses on the last stage", 2, golden=True,
           seed=f"{_R}:llama3_dpo", use_real_pg=True),
]
