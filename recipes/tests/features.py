"""Runs the `features` integration suite trains (entries live in tests/integration_tests/).

Small, deterministic and quick on 2 CPU cores: 5 steps of the Llama 3 debug model (the layout is
under test, not the length: 5 steps exercise warmup, decay, and the optimizer state of every step).
"""

from dataclasses import replace

from recipes.llama3 import llama3
from titan_lightning.config import LRScheduleConfig, TrainingConfig
from titan_lightning.recipe import Run, on_layout, with_cp


def llama3_debugmodel() -> Run:
    """One rank, fp32, deterministic: the baseline every parallel layout is compared with."""
    run = llama3(
        "debugmodel",
        training=TrainingConfig(seq_len=128, tokens_per_microbatch_per_dp_rank=512, deterministic=True, seed=0),
        lr_schedule=LRScheduleConfig(warmup_steps=1),
    )
    run.trainer.update(
        max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    return run


def llama3_debugmodel_accumulation() -> Run:
    """Two microbatches per optimizer step, derived from tokens_per_step."""
    run = llama3_debugmodel()
    run.job.training.tokens_per_step = 2 * run.job.training.tokens_per_microbatch_per_dp_rank
    return run


def llama3_small() -> Run:
    """The debug model cut to 2 layers of width 128 over 4 sequences of 64 tokens, fp32: the seed of
    the bf16 layouts. bf16 matmuls run ~20x slower than fp32 on CPUs without native bf16 (one step
    of the debug model: 13.5 s against 0.6 s), and the precision path, not the size, is under test."""
    run = llama3_debugmodel()
    model, training = run.job.model, run.job.training
    model.dim, model.n_layers, model.n_heads, model.n_kv_heads = 128, 2, 8, 8
    training.seq_len, training.tokens_per_microbatch_per_dp_rank = 64, 256
    return run


def llama3_debugmodel_bf16() -> Run:
    """fp32 parameters, bf16 compute (autocast on one device), on the small shape."""
    run = llama3_small()
    run.job.training.mixed_precision_param = "bfloat16"
    return run


def _layout(**degrees) -> Run:
    return on_layout(llama3_debugmodel(), **degrees)


# Layouts, named by degree. The world size comes from the launch (--trainer.devices N).
def llama3_fsdp2() -> Run:
    return _layout(dp_shard=2)


def llama3_fsdp4() -> Run:
    return _layout(dp_shard=4)


def llama3_ddp2() -> Run:
    return _layout(dp_replicate=2, dp_shard=1)


def llama3_ddp4() -> Run:
    return _layout(dp_replicate=4, dp_shard=1)


def llama3_hsdp2x2() -> Run:
    return _layout(dp_replicate=2, dp_shard=2)


def llama3_tp2() -> Run:
    return _layout(dp_shard=1, tp=2)


def llama3_tp4() -> Run:
    return _layout(dp_shard=1, tp=4)


def llama3_tp2_no_sp() -> Run:
    return _layout(dp_shard=1, tp=2, sequence_parallel=False)


def llama3_tp4_no_sp() -> Run:
    return _layout(dp_shard=1, tp=4, sequence_parallel=False)


def llama3_fsdp2_tp2() -> Run:
    return _layout(dp_shard=2, tp=2)


def llama3_hsdp2x2_tp2() -> Run:
    """fsdp2_tp2 replicated twice: 8 ranks."""
    return _layout(dp_replicate=2, dp_shard=2, tp=2)


def llama3_fsdp2_tp2_bf16() -> Run:
    """bf16 parameters in compute, fp32 reduce (FSDP mixed precision), on the small shape."""
    run = on_layout(llama3_small(), dp_shard=2, tp=2)
    run.job.training.mixed_precision_param = "bfloat16"
    return run


def llama3_fsdp2_ac_full() -> Run:
    """Full activation checkpointing under FSDP2: every block's forward runs again in the backward."""
    run = llama3_fsdp2()
    run.job.activation_checkpoint.mode = "full"
    return run


def llama3_fsdp2_tp2_ac_op() -> Run:
    """Per-op selective activation checkpointing with DTensor (TP) ops inside each block."""
    run = llama3_fsdp2_tp2()
    run.job.activation_checkpoint.mode = "selective"
    run.job.activation_checkpoint.selective_ac_option = "op"
    return run


# Context parallel: the debug model's attention swapped for a CP backend (apply_transforms).
def _cp(attention: str = "allgather", **degrees) -> Run:
    return with_cp(llama3_debugmodel(), attention, **degrees)


def llama3_cp2() -> Run:
    """CP2, all-gather K/V, headtail load balancing (FSDP over the CP ranks)."""
    return _cp(cp=2, dp_shard=1)


def llama3_cp2_ring() -> Run:
    return _cp("ring", cp=2, dp_shard=1)


def llama3_cp2_ulysses() -> Run:
    return _cp("ulysses", cp=2, dp_shard=1)


def llama3_cp4() -> Run:
    return _cp(cp=4, dp_shard=1)


def llama3_cp4_ring() -> Run:
    return _cp("ring", cp=4, dp_shard=1)


def llama3_cp4_ulysses() -> Run:
    return _cp("ulysses", cp=4, dp_shard=1)


def llama3_fsdp2_cp2() -> Run:
    return _cp(cp=2, dp_shard=2)


def llama3_hsdp2_cp2() -> Run:
    """2 replicas, each FSDP over its 2 CP ranks: 4 ranks."""
    return _cp(cp=2, dp_replicate=2, dp_shard=1)


def llama3_fsdp2_tp2_cp2() -> Run:
    """FSDP2 x TP2 x CP2: 8 ranks."""
    return _cp(cp=2, dp_shard=2, tp=2)


# Pipeline parallel (real process groups only: the fake group moves no data between stages).
# The local batch (4 sequences, or 2 with dp_shard=2) splits into pp_microbatches.
def _pp(schedule: str = "1F1B", microbatches: int = 2, **degrees) -> Run:
    return _layout(pp_schedule=schedule, pp_microbatches=microbatches, **degrees)


def llama3_pp2() -> Run:
    """Two stages (embedding + 3 blocks | 3 blocks + head), 1F1B over 2 microbatches."""
    return _pp(pp=2, dp_shard=1)


def llama3_pp2_gpipe() -> Run:
    return _pp("GPipe", 4, pp=2, dp_shard=1)


def llama3_pp2_fsdp2() -> Run:
    """pp2 x FSDP2: 4 ranks; each stage FSDP-sharded over its 2 ranks."""
    return _pp(pp=2, dp_shard=2)


def llama3_pp2_tp2() -> Run:
    """pp2 x TP2 with GPipe: 4 ranks; hidden states cross stages sharded on the sequence."""
    return _pp("GPipe", 2, pp=2, dp_shard=1, tp=2)


def llama3_pp2_fsdp2_tp2() -> Run:
    """pp2 x FSDP2 x TP2: 8 ranks."""
    return _pp(pp=2, dp_shard=2, tp=2)


def llama3_pp2_interleaved() -> Run:
    """Interleaved 1F1B, 2 stages per rank (4 stages of the 6 blocks), 4 microbatches."""
    return _pp("Interleaved1F1B", 4, pp=2, dp_shard=1)


def llama3_pp2_looped_bfs() -> Run:
    return _pp("LoopedBFS", 4, pp=2, dp_shard=1)


def llama3_pp2_zero_bubble() -> Run:
    """Interleaved zero bubble: input and weight gradients computed as separate actions."""
    return _pp("InterleavedZeroBubble", 4, pp=2, dp_shard=1)


def llama3_pp2_zbv() -> Run:
    """Zero bubble with V-shaped placement: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2."""
    return _pp("ZBVZeroBubble", 4, pp=2, dp_shard=1)


def llama3_pp2_csv() -> Run:
    """A schedule read from a CSV file (torch's compute-only format): looped BFS written by hand,
    tests/assets/pp_schedules/looped_bfs_pp2_4stages_4mb.csv."""
    from titan_lightning.data.tokenizer import ASSETS_DIR

    run = _pp("LoopedBFS", 4, pp=2, dp_shard=1)
    run.job.parallelism.pp_schedule_csv = str(ASSETS_DIR / "pp_schedules" / "looped_bfs_pp2_4stages_4mb.csv")
    return run


# Save, then resume (tests/integration_tests/test_resume.py): the first part stops after step 2
# (its checkpoint written at step 2), the second resumes from the newest checkpoint of the run.
def _saving(run: Run) -> Run:
    from titan_lightning.testing.record import StopAtStep

    run.job.checkpoint.interval = 2
    run.trainer.update(enable_checkpointing=True, callbacks=[StopAtStep(2)])
    return run


def _resuming(run: Run) -> Run:
    run.job.checkpoint.resume_from = "latest"
    return run


def _every2(run: Run, *, async_save: bool = False) -> Run:
    """Saving every 2 steps (at 2 and 4 of 5) without stopping: training goes on while an async save is written."""
    run = _saving(run)
    run.trainer["callbacks"] = []
    run.job.checkpoint.async_save = async_save
    return run


def llama3_fsdp2_save() -> Run:
    return _saving(llama3_fsdp2())


def llama3_fsdp2_resume() -> Run:
    return _resuming(llama3_fsdp2())


def llama3_fsdp2_tp2_resume() -> Run:
    return _resuming(llama3_fsdp2_tp2())


def llama3_fsdp4_save() -> Run:
    """Saved on FSDP4, resumed on FSDP2 x TP2 (llama3_fsdp2_tp2_resume): another layout."""
    return _saving(llama3_fsdp4())


def llama3_fsdp2_every2() -> Run:
    return _every2(llama3_fsdp2())


def llama3_fsdp2_every2_async() -> Run:
    return _every2(llama3_fsdp2(), async_save=True)


def llama3_fsdp2_tp2_every2_async() -> Run:
    return _every2(llama3_fsdp2_tp2(), async_save=True)


def llama3_pp2_every2() -> Run:
    """pp2 saving every 2 steps without stopping (the kill-during-save test dies in a save)."""
    return _every2(llama3_pp2())


def llama3_pp2_every2_async() -> Run:
    return _every2(llama3_pp2(), async_save=True)


def llama3_fsdp2_sigterm() -> Run:
    """FSDP2 on 2 ranks, rank 1 sent SIGTERM after step 3: every rank saves step 3 and stops."""
    import signal

    from titan_lightning.testing.record import SignalAtStep

    run = llama3_fsdp2()
    run.trainer["callbacks"] = [SignalAtStep(3, rank=1, signum=signal.SIGTERM)]
    return run


def llama3_pp2_resume() -> Run:
    return _resuming(llama3_pp2())


def _compiled(run: Run) -> Run:
    """Blocks and loss compiled with aot_eager: the graphs inductor would get, without generating
    kernels (quick on CPU)."""
    run.job.compile.enable = True
    run.job.compile.backend = "aot_eager"
    return run


def llama3_pp2_fsdp2_compile() -> Run:
    """Each block compiled (and the loss) inside two FSDP2 pipeline stages; the aot_eager backend
    traces the same graphs as inductor without generating kernels (quick on CPU)."""
    return _compiled(llama3_pp2_fsdp2())


def llama3_fsdp2_compile_ac() -> Run:
    """Compile over per-op selective activation checkpointing, FSDP2."""
    run = _compiled(llama3_fsdp2())
    run.job.activation_checkpoint.mode = "selective"
    return run


# Gradient accumulation on FSDP2: 1 sequence per rank per microbatch, 2 microbatches per step:
# 2 ranks x 2 microbatches = the 4 sequences the one-process baseline trains in one step.
def llama3_fsdp2_accumulation() -> Run:
    run = llama3_fsdp2()
    t = run.job.training
    t.tokens_per_step = 4 * t.seq_len
    t.tokens_per_microbatch_per_dp_rank = t.seq_len
    return run


def llama3_fsdp2_accumulation_last_sync() -> Run:
    """As llama3_fsdp2_accumulation, the gradients reduce-scattered once per step, after the last microbatch."""
    run = llama3_fsdp2_accumulation()
    run.job.parallelism.fsdp_sync_last_microbatch_only = True
    return run


def llama3_fsdp2_tp2_compile() -> Run:
    """FSDP2 x TP2 with compiled blocks: under TP each block's children are compiled on their own
    (parallel/compile.py says why); aot_eager on CPU."""
    return _compiled(llama3_fsdp2_tp2())


# Document masking: block-causal attention and per-document RoPE positions (model.mask, model.positions).
def _block_causal(run: Run) -> Run:
    run.job.model.mask, run.job.model.positions = "block_causal", "per_document"
    return run


def llama3_debugmodel_block_causal() -> Run:
    """The one-process baseline with document masking: the seed of the masked layouts."""
    return _block_causal(llama3_debugmodel())


def llama3_fsdp2_cp2_block_causal() -> Run:
    """FSDP2 x CP2 (all-gather K/V) with document masking: each CP rank masks its head-tail slices
    against the gathered keys with the global document ids."""
    return _block_causal(llama3_fsdp2_cp2())


# The chunked loss (training.loss_chunks): head and cross-entropy over 3 chunks of the tokens
# (which do not divide them), never holding full logits; the seed is the plain-loss baseline.
def _chunked_loss(run: Run) -> Run:
    run.job.training.loss_chunks = 3
    return run


def llama3_fsdp2_tp2_chunked_loss() -> Run:
    """FSDP2 x TP2 (sequence parallel): each rank's vocab shard of every chunk's logits, the head
    called once after the model's forward (FSDP2 completes its unit then)."""
    return _chunked_loss(llama3_fsdp2_tp2())


def llama3_pp2_chunked_loss() -> Run:
    """PP2: the last stage returns hidden states; its loss applies the head chunk by chunk."""
    return _chunked_loss(llama3_pp2())


# Supervised fine-tuning (data.sft): conversations packed whole with document masking, the loss over
# the assistant's tokens divided by the supervised tokens of the whole step. The data
# (titan_lightning/testing/sft_shards.py) gives windows and ranks very different numbers of
# supervised tokens; each layout must reproduce the one-process run.
def _sft(run: Run) -> Run:
    from titan_lightning.testing.sft_shards import cached_synthetic_set  # (writes the set once, when asked)

    job = run.job
    # next-fit packing (conversations in corpus order) as when the goldens were written; best_fit, the
    # default, is run by tests/unit_tests/cpu/test_readme.py (recipes.hf:sft) and test_sft_data.py
    run.set_job(replace(job, data=replace(job.data, dataset_path=str(cached_synthetic_set()), sft=True,
                                          sft_packing="packed"),
                        model=replace(job.model, mask="block_causal", positions="per_document")))
    return run


def llama3_sft() -> Run:
    """One process: the seed of the SFT layouts."""
    return _sft(llama3_debugmodel())


def llama3_sft_accumulation() -> Run:
    """The same global batch in two microbatches per step."""
    run = llama3_sft()
    t = run.job.training
    run.set_job(replace(run.job, training=replace(t, tokens_per_step=t.tokens_per_microbatch_per_dp_rank,
                                                  tokens_per_microbatch_per_dp_rank=t.tokens_per_microbatch_per_dp_rank // 2)))
    return run


def llama3_sft_fsdp2() -> Run:
    return _sft(llama3_fsdp2())


def llama3_sft_fsdp2_tp2() -> Run:
    return _sft(llama3_fsdp2_tp2())


def llama3_sft_pp2() -> Run:
    return _sft(llama3_pp2())


def llama3_sft_cp2() -> Run:
    return _sft(llama3_cp2())


def llama3_sft_fsdp2_every2() -> Run:
    """SFT on FSDP2 saving at steps 2 and 4 (tests/integration_tests/test_resume.py resumes it on FSDP2
    and on one process)."""
    return _every2(llama3_sft_fsdp2())



# LoRA (job.lora): adapters on every linear (rank 4, alpha 8), the base frozen, on llama3_small's
# shape for 3 steps (CI time: the layout is under test); each layout reproduces the one-process
# LoRA run (titan_lightning/lora/parallel.py says how each layout holds the adapters).
def llama3_lora() -> Run:
    """One process: the seed of the LoRA layouts."""
    from titan_lightning.config.lora import LoRAConfig

    run = llama3_small()
    run.job.lora = LoRAConfig(rank=4, alpha=8.0)
    run.trainer["max_steps"] = 3
    return run


def _accumulation(run: Run) -> Run:
    """One process, llama3_small's 4 sequences a step in 2 microbatches."""
    t = run.job.training
    t.tokens_per_step = t.tokens_per_microbatch_per_dp_rank
    t.tokens_per_microbatch_per_dp_rank //= 2
    return run


def _fsdp2_accumulation(run: Run) -> Run:
    """FSDP2 with 2 accumulated microbatches of 1 sequence per rank: llama3_small's 4 sequences per step."""
    run = on_layout(run, dp_shard=2)
    t = run.job.training
    t.tokens_per_step, t.tokens_per_microbatch_per_dp_rank = 4 * t.seq_len, t.seq_len
    return run


def _pp2(run: Run) -> Run:
    """PP2, 1F1B over 2 microbatches: one layer of llama3_small's two on each stage."""
    return on_layout(run, dp_shard=1, pp=2, pp_schedule="1F1B", pp_microbatches=2)


def llama3_lora_accumulation() -> Run:
    return _accumulation(llama3_lora())


def llama3_lora_fsdp2_accumulation() -> Run:
    return _fsdp2_accumulation(llama3_lora())


def llama3_lora_tp2() -> Run:
    return on_layout(llama3_lora(), dp_shard=1, tp=2)


def llama3_lora_cp2() -> Run:
    return with_cp(llama3_lora(), "allgather", cp=2, dp_shard=1)


def llama3_lora_cp2_ring() -> Run:
    return with_cp(llama3_lora(), "ring", cp=2, dp_shard=1)


def llama3_lora_cp2_ulysses() -> Run:
    return with_cp(llama3_lora(), "ulysses", cp=2, dp_shard=1)


def llama3_lora_pp2() -> Run:
    return _pp2(llama3_lora())


# QLoRA (lora.quantize_base nf4): the LoRA runs at the debug model's width (256: every weight holds 4
# or more NF4 scale blocks, so 2 ranks keep whole ones), the base stored as NF4.
def llama3_qlora() -> Run:
    """One process: the seed of the QLoRA layouts."""
    run = llama3_lora()
    model = run.job.model
    model.dim, model.n_heads, model.n_kv_heads = 256, 16, 16
    run.job.lora.quantize_base = "nf4"
    return run


def llama3_qlora_fsdp2_accumulation() -> Run:
    """FSDP2, the NF4 base sharded on its rows, 2 accumulated microbatches per rank."""
    return _fsdp2_accumulation(llama3_qlora())


# Preference training (job.preference, DPO): 48 pairs whose answers run from 1 to 20 tokens, packed
# whole, on llama3_small's shape for 3 steps; each layout reproduces the one-process DPO run, whose
# loss is the mean over each step's pairs (titan_lightning/objectives/preference.py), its reference
# precomputed from the starting weights on the layout itself.
def llama3_dpo() -> Run:
    """One process: the seed of the DPO layouts."""
    from titan_lightning.config.preference import PreferenceConfig
    from titan_lightning.testing.sft_shards import cached_synthetic_set  # (writes the set once, when asked)

    run = _sft(llama3_small())
    run.job.data.dataset_path, run.job.data.val_fraction = str(cached_synthetic_set(48, pairs=True)), 0.0
    run.job.preference = PreferenceConfig(loss="dpo")
    run.trainer["max_steps"] = 3
    return run


def llama3_dpo_accumulation() -> Run:
    return _accumulation(llama3_dpo())


def llama3_dpo_fsdp2_accumulation() -> Run:
    return _fsdp2_accumulation(llama3_dpo())


def llama3_dpo_fsdp2_frozen() -> Run:
    """The reference a frozen copy of the starting model, sharded like it (FSDP units of its own)."""
    run = on_layout(llama3_dpo(), dp_shard=2)
    run.job.preference.reference = "frozen"
    return run


def llama3_dpo_tp2() -> Run:
    return on_layout(llama3_dpo(), dp_shard=1, tp=2)


def llama3_dpo_cp2_ring() -> Run:
    """Contiguous halves (no load balancer): under the fake group, whose sums over cp are a rank's own
    part, the first half still holds whole pairs to count."""
    return with_cp(llama3_dpo(), "ring", cp=2, dp_shard=1, cp_load_balancer=None)


def llama3_dpo_pp2() -> Run:
    return _pp2(llama3_dpo())


def llama3_lora_pp2_every2() -> Run:
    """llama3_lora_pp2 saving its adapters at step 2 (test_lora_layouts resumes it)."""
    return _every2(llama3_lora_pp2())
