"""Tokens/s, MFU and peak memory of titan_lightning next to the alternatives, one device.

    python -m benchmarks.throughput --workload llama3_1b                  # one H200: ~8 min
    python -m benchmarks.throughput --workload llama3_8b_shape --layers 8
    python -m benchmarks.throughput --workload llama3_8b_shape --contenders titan,bare --sdpa cudnn   # a kernel experiment
    python -m benchmarks.throughput --workload debug --device cpu --steps 3 --warmup 2   # the harness
    python -m benchmarks.throughput --contenders titan,bare \
        --workload llama3_8b_shape,llama3_8b_shape_float8_tensorwise,llama3_8b_shape_float8_rowwise  # bf16 and float8

Every contender trains the same model shape on the same tokens (the shipped corpus through
``TextDataModule``), bf16 mixed precision with fp32 master weights, fused AdamW, clipping at
1.0, and the workload's per-block compile and activation checkpointing:

    titan        ``titan-lightning fit --recipe ...``: TitanStrategy through the normal Trainer
                 path, the recipe as a user runs it (CSV and TensorBoard loggers, metrics
                 callback) minus validation and checkpoints
    bare         the same model, the same parallelize calls (AC, compile_blocks, the compiled
                 loss), autocast and optimizer in a plain loop: the framework-overhead floor
    lightning    Lightning's own ModelParallelStrategy, FSDP2 (mixed-precision policy) applied
                 in ``configure_model`` as its docs show, the same AC and compile calls
    hf           Hugging Face transformers' LlamaForCausalLM (SDPA) in a plain loop with
                 autocast, the way many users train today (no compile, no AC)
    torchtitan   torchtitan's released trainer (benchmarks/contenders/torchtitan_run.py) on its
                 own Llama 3, Qwen 3 and DeepSeek V3 models of our shapes (``torchtitan_model``),
                 float8 through its own converter; the differences that remain are in its docstring
    hf_padded / hf_packed / trl   fine-tuning workloads: transformers' model of the folder in a
                 plain loop on the same conversations (padded rows as TRL feeds them, or our
                 packing), and TRL's SFTTrainer itself (``run_trl``; needs trl and datasets)

A ``*_float8_<recipe>`` workload turns on ``quantize.float8`` (torchao, needs the ``float8``
extra and an SM89+ GPU): titan, bare and lightning convert the same linears (``_build_model``),
torchtitan through its own float8 converter with the same torchao recipe and filter.
Several workloads, comma-separated, share one table (rows "contender (workload)"; "vs" against
that workload's own bare loop, or against the row ``--reference`` names).

Each contender runs in its own process; ``--rounds`` repeats the set in alternating order
(A B C, C B A, ...) so that drift of the machine falls on all of them alike. Step time is
the wall time between the ends of consecutive optimizer steps, the device synchronized, so
it includes data loading and everything the loop does; the first ``--warmup`` steps
(compilation) are dropped. ``BENCH_CLOCK=events`` (a GPU): the steps are timed by CUDA events
recorded at their ends instead, read once after the last one, and the losses read then too, so
the clock never makes the host wait for the device (as a long run that logs rarely: the
synchronization after each step exposes the host's work before the next one; a contender's own
reads, such as the bare loop's clipping norm, still wait). Peak memory is
``torch.cuda.max_memory_allocated`` over the measured steps. MFU = tokens/s x the model's training
FLOPs per token (``flops_per_token``, the same formula for every contender) / the device's dense
bf16 peak.

Where a step's time goes, on a GPU: ``--profile-steps N`` traces N steps after the measured ones
(device busy time, kernel families, the host calls that took longest); ``BENCH_TRACE=DIR`` keeps
that trace (``DIR/<contender>_<workload>_trace.json.gz``, ui.perfetto.dev);
``BENCH_SYNC_AUDIT=DIR`` lists every call that made the host wait for the device in the first
measured step, by the Python frames that made it (``DIR/<contender>_<workload>_syncs.txt``);
``BENCH_MEMORY_SNAPSHOT=DIR`` records the first measured step's allocations.
"""

import argparse
import contextlib
import dataclasses
import gzip
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
CONTENDERS = ("titan", "bare", "lightning", "hf", "torchtitan", "hf_padded", "hf_packed", "trl")


@dataclasses.dataclass(kw_only=True)
class Workload:
    recipe: str
    seq_len: int = 8192
    compile: bool = True
    ac: str = "selective"  # activation_checkpoint.mode of every contender that has one
    layers: Optional[int] = None  # fewer layers than the flavor, same per-layer shapes
    hf_ac: bool = False  # gradient checkpointing for the HF contender (where it would not fit)
    overrides: tuple[str, ...] = ()  # more ``titan-lightning fit`` arguments
    profile_steps: int = 0  # steps traced after the measured ones: the device's busy time per step
    contenders: tuple[str, ...] = CONTENDERS
    # A Hugging Face folder of a real model's shape and a prepared chat set (benchmarks/finetune_folder.py:
    # (shape, layers or None for all)), passed to the recipe as --job.checkpoint.initial_load_path and,
    # for an SFT recipe, --job.data.dataset_path.
    folder: Optional[tuple[str, Optional[int]]] = None
    # The command a user types: only the recipe, its paths, the device and the step count (plus
    # ``overrides``); the run's own settings (precision, compile, lengths, AC) are the recipe's choice.
    as_user: bool = False
    # The folder's preference pairs (benchmarks/preference_pairs.py) as the data, not its chats.
    pairs: bool = False


def float8_overrides(recipe: str, emulate: bool = False) -> tuple[str, ...]:
    """``quantize.float8`` with torchao's ``recipe`` (``emulate``: no float8 kernels, a CPU's way)."""
    return ("--job.quantize.float8.enable", "true", "--job.quantize.float8.recipe", recipe,
            "--job.quantize.float8.emulate", str(emulate).lower())


# What converts the same linears as titan: our model through our parallelize calls, and
# torchtitan's trainer with its float8 converter (torchao's same recipe; HF's model would need
# its own float8 setup).
FLOAT8_CONTENDERS = ("titan", "bare", "lightning", "torchtitan")

WORKLOADS: dict[str, Workload] = {
    "llama3_1b": Workload(recipe="recipes.llama3:llama3_1b"),
    # Document masking (models/common/masking.py) on the shipped corpus's packed documents.
    "llama3_1b_flex_causal": Workload(recipe="recipes.llama3:llama3_1b", contenders=("titan",),
                                      overrides=("--job.model.attention", "flex")),
    "llama3_1b_flex_docs": Workload(recipe="recipes.llama3:llama3_1b", contenders=("titan",),
                                    overrides=("--job.model.attention", "flex", "--job.model.mask", "block_causal")),
    "llama3_1b_varlen_docs": Workload(recipe="recipes.llama3:llama3_1b", contenders=("titan",),
                                      overrides=("--job.model.attention", "varlen", "--job.model.mask", "block_causal")),
    "llama3_3b": Workload(recipe="recipes.llama3:llama3_3b"),
    # torchtitan's per-op AC policy (every second matmul of a block recomputed): the memory rows.
    "llama3_1b_op_lean": Workload(recipe="recipes.llama3:llama3_1b",
                                  overrides=("--job.activation_checkpoint.selective_ac_option", "op_lean")),
    # Llama 3 8B's per-layer shapes (dim 4096, GQA 32/8, FFN 14336, vocab 128256), fewer layers.
    "llama3_8b_shape": Workload(recipe="recipes.llama3:llama3_8b", layers=8),
    "llama3_8b_shape_op_lean": Workload(recipe="recipes.llama3:llama3_8b", layers=8,
                                        overrides=("--job.activation_checkpoint.selective_ac_option", "op_lean")),
    # The same with the chunked head + loss (training.loss_chunks): the peak without full logits.
    "llama3_8b_shape_chunked_loss": Workload(recipe="recipes.llama3:llama3_8b", layers=8,
                                             overrides=("--job.training.loss_chunks", "16"),
                                             contenders=("titan", "bare", "lightning")),
    # The same with float8 linears (torchao; titan, the bare loop, Lightning and torchtitan
    # convert the same ones, the head stays bf16). On one GPU next to bf16:
    #   --workload llama3_8b_shape,llama3_8b_shape_float8_tensorwise,llama3_8b_shape_float8_rowwise
    **{f"{name}_float8_{recipe}": Workload(recipe=f"recipes.llama3:{flavor}", layers=layers,
                                           overrides=float8_overrides(recipe), contenders=FLOAT8_CONTENDERS)
       for name, flavor, layers in (("llama3_1b", "llama3_1b", None), ("llama3_8b_shape", "llama3_8b", 8))
       for recipe in ("tensorwise", "rowwise")},
    # Qwen 3 30B-A3B's layers (128 experts, top 8, grouped GEMM), fewer of them; the MoE layers
    # compiled inside their blocks (compile.components' default 'moe').
    "qwen3_30b_a3b_shape": Workload(recipe="recipes.qwen3:qwen3_30b_a3b", layers=4, seq_len=4096,
                                    contenders=("titan", "bare", "lightning", "hf", "torchtitan")),
    # The same, spelled out (the name of the rows in benchmarks/RESULTS.md before 'moe' was a default).
    "qwen3_30b_a3b_shape_compiled_moe": Workload(recipe="recipes.qwen3:qwen3_30b_a3b", layers=4, seq_len=4096,
                                                 overrides=("--job.compile.components", "[model,loss,moe]"),
                                                 contenders=("titan", "bare", "lightning")),
    # The same with the MoE layers eager between compiled parts (the default before).
    "qwen3_30b_a3b_shape_eager_moe": Workload(recipe="recipes.qwen3:qwen3_30b_a3b", layers=4, seq_len=4096,
                                              overrides=("--job.compile.components", "[model,loss]"),
                                              contenders=("titan", "bare", "lightning")),
    # Qwen 2.5 7B's layers (dim 3584, GQA 28/4, q/k/v biases, FFN 18944, vocab 152064), 8 of 28.
    "qwen2_5_7b_shape": Workload(recipe="recipes.qwen2:qwen2_5_7b", layers=8, contenders=("titan", "bare")),
    # Mistral Nemo 12B's layers (dim 5120, 32 heads of 128, 8 KV heads, FFN 14336, vocab 131072), 8 of 40.
    "mistral_nemo_12b_shape": Workload(recipe="recipes.mistral:mistral_nemo_12b", layers=8, contenders=("titan", "bare")),
    # Phi-4's layers (dim 5120, GQA 40/10 of 128, FFN 17920, vocab 100352), 8 of 40.
    "phi4_14b_shape": Workload(recipe="recipes.phi3:phi4", layers=8, contenders=("titan", "bare")),
    # OLMo 2 7B's layers (dim 4096, 32 heads, post-norms, QK-norm over whole projections, FFN 11008), 8 of 32.
    "olmo2_7b_shape": Workload(recipe="recipes.olmo2:olmo2_7b", layers=8, seq_len=4096, contenders=("titan", "bare")),
    # Mixtral 8x7B's layers (8 experts of 14336, top 2, grouped GEMM), 2 of 32.
    "mixtral_8x7b_shape": Workload(recipe="recipes.mistral:mixtral_8x7b", layers=2, seq_len=4096,
                                   contenders=("titan", "bare")),
    # gpt-oss-20b's layers (dim 2880, 64 heads of 64 over 8 KV heads with biases and sinks, sliding
    # window 128 / full alternating, YaRN; 32 experts of 2880 with biases, top 4, clamped SwiGLU), 4 of 24.
    "gpt_oss_20b_shape": Workload(recipe="recipes.gpt_oss:gpt_oss_20b", layers=4, seq_len=4096, contenders=("titan", "bare"),
                                  overrides=("--job.model.layer_types", "[" + ",".join(
                                      ["sliding_attention", "full_attention"] * 2) + "]")),
    # The same on FlexAttention (the sinks from its log-sum-exp; sdpa's, with the sliding layers'
    # mask, take the memory-efficient kernel, not flash).
    "gpt_oss_20b_shape_flex": Workload(recipe="recipes.gpt_oss:gpt_oss_20b", layers=4, seq_len=4096,
                                       contenders=("titan",), overrides=(
                                           "--job.model.layer_types", "[" + ",".join(
                                               ["sliding_attention", "full_attention"] * 2) + "]",
                                           "--job.model.attention", "flex")),
    # Gemma 3 12B's layers (dim 3840, 16 heads of 256 over 8 KV heads, GeGLU 15360, vocab 262208, four
    # norms a block), 8 of 48 in its pattern: 5 sliding (window 1024, varlen) and 1 global, then 2 sliding.
    "gemma3_12b_shape": Workload(recipe="recipes.gemma3:gemma3_12b", layers=8, contenders=("titan", "bare"),
                                 overrides=("--job.model.layer_types", json.dumps(
                                     ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2),
                                     "--job.model.attention", "varlen")),
    # DeepSeek V3 16B-shaped layers (DeepSeek-V2-Lite's sizes: dim 2048, MLA kv rank 512, 64 routed
    # experts of 1408 + 2 shared, top 6) with V3's routing: sigmoid scores normalized over the top
    # k, picked from the 4 best of 8 expert groups; the dense first layer and 3 MoE layers.
    "deepseek_v3_16b_shape": Workload(recipe="recipes.deepseek_v3:deepseek_v3_16b", layers=4, seq_len=4096,
                                      contenders=("titan", "bare", "lightning", "hf", "torchtitan"),
                                      overrides=("--job.model.moe.score_func", "sigmoid", "--job.model.moe.route_norm",
                                                 "true", "--job.model.moe.num_groups", "8",
                                                 "--job.model.moe.top_k_groups", "4")),
    # The same with the MoE layers compiled inside their blocks.
    "deepseek_v3_16b_shape_compiled_moe": Workload(recipe="recipes.deepseek_v3:deepseek_v3_16b", layers=4, seq_len=4096,
                                                   contenders=("titan", "bare"),
                                                   overrides=("--job.model.moe.score_func", "sigmoid",
                                                              "--job.model.moe.route_norm", "true",
                                                              "--job.model.moe.num_groups", "8",
                                                              "--job.model.moe.top_k_groups", "4",
                                                              "--job.compile.components", "[model,loss,moe]")),
    # The MoE harness on CPU: Qwen 3 MoE debug model, eager.
    # (Not torchtitan: its MoE routing calls torch.histc on integers, which has no CPU kernel.)
    "debug_moe": Workload(recipe="recipes.qwen3:debugmodel_moe", seq_len=128, compile=False,
                          contenders=("titan", "bare", "lightning", "hf")),
    # The harness itself on CPU: the Llama 3 debug model, eager.
    "debug": Workload(recipe="recipes.llama3:debugmodel", seq_len=256, compile=False),
    # Framework overhead: a model so small that a step is mostly the loop's own Python.
    "overhead": Workload(recipe="recipes.llama3:debugmodel", seq_len=32, compile=False, ac="none",
                         overrides=("--job.model.dim", "64", "--job.model.n_layers", "1", "--job.model.n_heads", "2",
                                    "--job.model.n_kv_heads", "1")),
}
# Supervised fine-tuning (data.sft) on benchmarks/sft_data.py's synthetic chat set (write it first:
# python -m benchmarks.sft_data): conversations packed whole into 8192-token windows with varlen
# attention per conversation, or one per row padded (4096-token rows, 2 per step, cut to the
# longest); titan only (the loss normalization and the data path are ours). Next to the pretraining
# row of the same shape: python -m benchmarks.throughput --contenders titan --workload
#   llama3_1b,llama3_1b_sft_packed,llama3_1b_sft_best_fit,llama3_1b_sft_padded
def _sft_overrides(packing: str) -> tuple[str, ...]:
    from benchmarks.sft_data import DEFAULT, SFT_BENCH_ENV

    return ("--job.data.dataset_path", os.environ.get(SFT_BENCH_ENV, DEFAULT), "--job.data.sft", "true",
            "--job.data.sft_packing", packing, "--job.data.repeat_to_fit", "false", "--job.model.mask",
            "block_causal", "--job.model.positions", "per_document", "--job.model.attention", "varlen")


for _name, _flavor, _layers in (("llama3_1b", "llama3_1b", None), ("llama3_8b_shape", "llama3_8b", 8)):
    WORKLOADS[f"{_name}_sft_packed"] = Workload(recipe=f"recipes.llama3:{_flavor}", layers=_layers,
                                                contenders=("titan",), overrides=_sft_overrides("packed"))
    WORKLOADS[f"{_name}_sft_best_fit"] = Workload(recipe=f"recipes.llama3:{_flavor}", layers=_layers,
                                                  contenders=("titan",), overrides=_sft_overrides("best_fit"))
    WORKLOADS[f"{_name}_sft_padded"] = Workload(recipe=f"recipes.llama3:{_flavor}", layers=_layers, seq_len=4096,
                                                contenders=("titan",), overrides=_sft_overrides("padded") + (
                                                    "--job.training.tokens_per_microbatch_per_dp_rank", "8192"))

# Sliding-window attention (model.sliding_window: each query sees the 4096 keys before it, itself
# included) against full causal attention, every layer, at seq 8192 and 32768 (issue #38):
#   --contenders titan --workload llama3_1b,llama3_1b_sliding4k_varlen,llama3_1b_seq32k,llama3_1b_seq32k_sliding4k_varlen
_SLIDING = ("--job.model.sliding_window", "4096")
WORKLOADS.update({
    "llama3_1b_sliding4k_varlen": Workload(recipe="recipes.llama3:llama3_1b", contenders=("titan",),
                                           overrides=_SLIDING + ("--job.model.attention", "varlen")),
    "llama3_1b_sliding4k_flex": Workload(recipe="recipes.llama3:llama3_1b", contenders=("titan",),
                                         overrides=_SLIDING + ("--job.model.attention", "flex")),
    "llama3_1b_seq32k": Workload(recipe="recipes.llama3:llama3_1b", seq_len=32768, contenders=("titan",)),
    "llama3_1b_seq32k_sliding4k_varlen": Workload(recipe="recipes.llama3:llama3_1b", seq_len=32768, contenders=("titan",),
                                                  overrides=_SLIDING + ("--job.model.attention", "varlen")),
})

# Fine-tuning as a user runs it (issue #44): a Hugging Face folder of a real model's shape and 3,000 chat
# conversations (benchmarks/finetune_folder.py; made once per machine, before the contenders), then
#   _sft_default   the README's fine-tuning command with no tuning flag (the recipe chooses for the device)
#   _sft_tuned     the best hand-tuned flags found (bf16, compiled blocks, varlen, 4 x 4096 per microbatch);
#                  hf_padded / hf_packed: transformers' model of the folder in a plain loop, same lengths
#   _pretrain      recipes.hf:pretrained of the same folder at the tuned lengths (causal sdpa, shipped corpus)
# python -m benchmarks.throughput --rounds 1 --steps 10 --warmup 6 --reference 'titan (qwen2_5_1_5b_sft_tuned)' \
#   --workload qwen2_5_1_5b_sft_default,qwen2_5_1_5b_sft_tuned,qwen2_5_1_5b_pretrain
_TUNED = ("--trainer.precision", "bf16-mixed", "--job.compile.enable", "true", "--job.activation_checkpoint.mode", "none",
          "--job.training.seq_len", "4096", "--job.training.tokens_per_microbatch_per_dp_rank", "16384")
for _shape, _layers in (("qwen2_5_1_5b", None), ("llama3_8b", 16)):
    _name = _shape if _layers is None else f"{_shape}_{_layers}l"
    WORKLOADS[f"{_name}_sft_default"] = Workload(recipe="recipes.hf:sft", folder=(_shape, _layers), as_user=True,
                                                 contenders=("titan",))
    WORKLOADS[f"{_name}_sft_tuned"] = Workload(recipe="recipes.hf:sft", folder=(_shape, _layers), as_user=True,
                                               seq_len=4096, overrides=_TUNED + ("--job.model.attention", "varlen"),
                                               contenders=("titan", "hf_padded", "hf_packed", "trl"))
    # the same logging only every 100 steps: a bounded run of the README command logs every step
    # (an explicit 50, Lightning's default, is read as the default and scaled to the run's length)
    WORKLOADS[f"{_name}_sft_tuned_quiet"] = Workload(recipe="recipes.hf:sft", folder=(_shape, _layers), as_user=True,
                                                     seq_len=4096, contenders=("titan",), overrides=_TUNED + (
                                                         "--job.model.attention", "varlen", "--trainer.log_every_n_steps", "100"))
    WORKLOADS[f"{_name}_pretrain"] = Workload(recipe="recipes.hf:pretrained", folder=(_shape, _layers), as_user=True,
                                              seq_len=4096, overrides=_TUNED + ("--job.data.repeat_to_fit", "true"),
                                              contenders=("titan",))

# LoRA SFT (recipes.hf:lora: r 16, alpha 32, all-linear) of the whole 32-layer Llama 3 8B shape, one
# sequence of 4096 a step (issue #48's bar): titan against transformers + peft on the same packed windows
# (hf_packed with the job's lora: the base in bf16, PEFT's fp32 adapters, fused AdamW on them), and with
# gradient checkpointing (_hf_ac).
# python -m benchmarks.throughput --rounds 1 --steps 10 --warmup 6 --reference 'titan (llama3_8b_lora)' \
#   --workload llama3_8b_lora,llama3_8b_lora_hf_ac
_LORA = ("--trainer.precision", "bf16-mixed", "--job.compile.enable", "true",
         "--job.activation_checkpoint.mode", "none", "--job.training.seq_len", "4096",
         "--job.training.tokens_per_microbatch_per_dp_rank", "4096", "--job.model.attention", "varlen")
WORKLOADS["llama3_8b_lora"] = Workload(recipe="recipes.hf:lora", folder=("llama3_8b", None), as_user=True,
                                       seq_len=4096, overrides=_LORA, contenders=("titan", "hf_packed"))
WORKLOADS["llama3_8b_lora_hf_ac"] = dataclasses.replace(WORKLOADS["llama3_8b_lora"], hf_ac=True,
                                                        contenders=("hf_packed",))
# The same adapters over float8 base linears (--job.quantize.float8.enable true, tensorwise: the frozen
# base's matmuls and the activations' gradients through it in float8, the adapters in bf16; not PEFT's
# precision, a row of its own next to the bf16 one).
WORKLOADS["llama3_8b_lora_float8"] = dataclasses.replace(
    WORKLOADS["llama3_8b_lora"], overrides=_LORA + ("--job.quantize.float8.enable", "true"), contenders=("titan",))
# QLoRA (recipes.hf:qlora: the same adapters on an NF4 base) of the same shape: tokens/s and peak memory.
WORKLOADS["llama3_8b_qlora"] = dataclasses.replace(WORKLOADS["llama3_8b_lora"], recipe="recipes.hf:qlora",
                                                   contenders=("titan",))


def _variant(base: str, *overrides: str, **changes: Any) -> Workload:
    """Workload ``base`` with more ``titan-lightning fit`` arguments (and other fields changed)."""
    return dataclasses.replace(WORKLOADS[base], overrides=WORKLOADS[base].overrides + overrides, **changes)


# The same three rows logging every 100 steps, as a fine-tune of thousands of steps logs (a bounded run
# of the README command logs every step: ten values read off the device after each); with
# BENCH_CLOCK=events neither contender waits for the device between steps either (issue #48's bar):
# BENCH_CLOCK=events python -m benchmarks.throughput --rounds 1 --steps 5 --warmup 4 \
#   --reference 'titan (llama3_8b_lora_quiet)' \
#   --workload llama3_8b_lora_quiet,llama3_8b_lora_float8_quiet,llama3_8b_qlora_quiet
for _lora_name in ("llama3_8b_lora", "llama3_8b_lora_float8", "llama3_8b_qlora"):
    WORKLOADS[f"{_lora_name}_quiet"] = _variant(_lora_name, "--trainer.log_every_n_steps", "100")
# With activation checkpointing, next to PEFT's gradient checkpointing (run 8: 22.4 GiB; the issue's "at
# <= its peak memory" against that row), and QLoRA fully checkpointed (torchtune's < 10 GB figure):
# BENCH_CLOCK=events python -m benchmarks.throughput --rounds 1 --steps 5 --warmup 4 \
#   --reference 'titan (llama3_8b_lora_quiet)' \
#   --workload llama3_8b_lora_quiet,llama3_8b_lora_selective_quiet,llama3_8b_lora_hf_ac,llama3_8b_qlora_full_quiet
WORKLOADS["llama3_8b_lora_selective_quiet"] = _variant(
    "llama3_8b_lora_quiet", "--job.activation_checkpoint.mode", "selective", contenders=("titan",))
# Fully checkpointed LoRA (estimate 18.5 GiB) next to PEFT with gradient checkpointing (22.4 GiB, run 8):
WORKLOADS["llama3_8b_lora_full_quiet"] = _variant(
    "llama3_8b_lora_quiet", "--job.activation_checkpoint.mode", "full", contenders=("titan",))
# The gradient norm read one compiled call per gradient (before its small gradients were packed: 448
# adapter gradients, ~35 ms of the host per step on an H100 profile, run 9), the same run otherwise:
WORKLOADS["llama3_8b_lora_norm_per_tensor_quiet"] = _variant(
    "llama3_8b_lora_quiet", "--trainer.callbacks+", "benchmarks.grad_norm_ab.PerTensorGradNorm", contenders=("titan",))
# Inductor's combo kernels on (the adapters' ~900 small cast kernels a step launched in fewer calls), the
# same run otherwise (benchmarks/inductor_ab.py):
WORKLOADS["llama3_8b_lora_combo_quiet"] = _variant(
    "llama3_8b_lora_quiet", "--trainer.callbacks+", "benchmarks.inductor_ab.ComboKernels", contenders=("titan",))
# Each adapter's A on its own GEMM (before q / k / v and gate / up shared one under compile), the same
# run otherwise (benchmarks/lora_ab.py):
WORKLOADS["llama3_8b_lora_separate_a_quiet"] = _variant(
    "llama3_8b_lora_quiet", "--trainer.callbacks+", "benchmarks.lora_ab.SeparateAdapterInputs", contenders=("titan",))
WORKLOADS["llama3_8b_qlora_full_quiet"] = _variant("llama3_8b_qlora_quiet", "--job.activation_checkpoint.mode", "full")

# QLoRA of Llama 3 70B's shape (80 layers, random weights: recipes.llama3:llama3_70b, the shipped corpus)
# on one H200 at seq 4096, full activation checkpointing (issue #48); MFU counts 6 FLOPs per parameter
# and token as for every row (LoRA computes no weight gradients of the base: ~4 of them).
# python -m benchmarks.throughput --rounds 1 --steps 4 --warmup 2 --workload llama3_70b_qlora --contenders titan
WORKLOADS["llama3_70b_qlora"] = Workload(recipe="recipes.llama3:llama3_70b", seq_len=4096, ac="full", contenders=("titan",),
                                         overrides=("--job.lora.rank", "16", "--job.lora.alpha", "32",
                                                    "--job.lora.quantize_base", "nf4"))

# The fine-tuning contenders on CPU, on a tiny folder (that each runs; its numbers mean nothing):
#   python -m benchmarks.throughput --device cpu --steps 2 --warmup 1 --workload tiny_sft --contenders titan,hf_padded,trl
WORKLOADS["tiny_sft"] = Workload(recipe="recipes.hf:sft", folder=("tiny", None), as_user=True, seq_len=512,
                                 overrides=("--job.training.seq_len", "512",
                                            "--job.training.tokens_per_microbatch_per_dp_rank", "2048"),
                                 contenders=("titan", "hf_padded", "hf_packed", "trl"))
WORKLOADS["tiny_lora"] = dataclasses.replace(WORKLOADS["tiny_sft"], recipe="recipes.hf:lora",
                                             contenders=("titan", "hf_packed"))

# Preference training (issue #49) as a user runs it: recipes.hf:dpo on the folder's pairs (each chat's
# last answer against the next chat's; benchmarks/preference_pairs.py), no tuning flag, per reference
# mode, next to the same folder's SFT row (_sft_default). MFU counts the policy's FLOPs only (the
# reference's forward, where there is one, is not counted).
# python -m benchmarks.throughput --rounds 1 --steps 8 --warmup 5 --reference 'titan (qwen2_5_1_5b_sft_default)' \
#   --workload qwen2_5_1_5b_sft_default,qwen2_5_1_5b_dpo,qwen2_5_1_5b_dpo_frozen,qwen2_5_1_5b_dpo_lora
for _shape, _layers in (("qwen2_5_1_5b", None), ("llama3_8b", 16), ("tiny", None)):
    _name = _shape if _layers is None else f"{_shape}_{_layers}l"
    _dpo = Workload(recipe="recipes.hf:dpo", folder=(_shape, _layers), as_user=True, pairs=True, contenders=("titan",))
    if _shape == "tiny":
        _dpo = dataclasses.replace(_dpo, seq_len=512, overrides=WORKLOADS["tiny_sft"].overrides)
    WORKLOADS[f"{_name}_dpo"] = _dpo  # reference log-probabilities precomputed before the first step
    WORKLOADS[f"{_name}_dpo_frozen"] = dataclasses.replace(
        _dpo, overrides=_dpo.overrides + ("--job.preference.reference", "frozen"))
    WORKLOADS[f"{_name}_dpo_lora"] = dataclasses.replace(_dpo, recipe="recipes.hf:dpo_lora")  # adapters_off

# The float8 path of the harness on CPU (torchao's emulation): titan and bare must agree.
WORKLOADS["overhead_float8"] = dataclasses.replace(
    WORKLOADS["overhead"], overrides=WORKLOADS["overhead"].overrides + float8_overrides("tensorwise", emulate=True),
    contenders=FLOAT8_CONTENDERS)


# -- what a contender trains ---------------------------------------------------------------


def cli_args(w: Workload, device: str, total_steps: int) -> list[str]:
    """The ``titan-lightning fit`` arguments of the workload; every contender's job comes from them."""
    if w.as_user:
        return _user_args(w, device, total_steps) + list(w.overrides)
    args = [
        "--recipe", w.recipe, "--trainer.accelerator", "gpu" if device == "cuda" else "cpu",
        "--trainer.devices", "1", "--trainer.max_steps", str(total_steps), "--trainer.limit_val_batches", "0",
        "--trainer.enable_checkpointing", "false", "--trainer.log_every_n_steps", "10",
        "--job.compile.enable", str(w.compile).lower(), "--job.activation_checkpoint.mode", w.ac,
        "--job.data.repeat_to_fit", "true", "--job.training.seq_len", str(w.seq_len),
        "--job.training.tokens_per_microbatch_per_dp_rank", str(w.seq_len),
    ]
    if w.layers is not None:
        args += ["--job.model.n_layers", str(w.layers)]
    return args + list(w.overrides)


def _user_args(w: Workload, device: str, total_steps: int) -> list[str]:
    """The README's fine-tuning command on the workload's folder, bounded to ``total_steps``, without
    validation, checkpoints or the export (they are not steps)."""
    from benchmarks.finetune_folder import folders

    model, data = folders(*w.folder)
    if w.pairs:
        data = data.parent / "pairs"
    args = ["--recipe", w.recipe, "--job.checkpoint.initial_load_path", str(model),
            "--trainer.accelerator", "gpu" if device == "cuda" else "cpu", "--trainer.devices", "1",
            "--trainer.max_steps", str(total_steps), "--trainer.limit_val_batches", "0",
            "--trainer.enable_checkpointing", "false", "--job.checkpoint.export_format", "null"]
    return args + (["--job.data.dataset_path", str(data)] if takes_dataset(w.recipe) else [])


def takes_dataset(recipe: str) -> bool:
    """Whether the recipe function ``module:name`` has a ``dataset_path`` argument (the fine-tuning
    ones: sft, lora, qlora, dpo, dpo_lora; pretrained reads its shipped corpus)."""
    import importlib
    import inspect

    module, _, name = recipe.partition(":")
    return "dataset_path" in inspect.signature(getattr(importlib.import_module(module), name)).parameters


def resolve_run(w: Workload, device: str, total_steps: int):
    """The recipe with the workload's overrides applied, exactly as the CLI applies them."""
    from titan_lightning.cli import parse_run

    return parse_run(cli_args(w, device, total_steps))


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def memory_snapshot_hook(step_after_warmup: int, name: str) -> None:
    """With ``BENCH_MEMORY_SNAPSHOT=DIR``: record every allocation of the first measured step (with
    Python stacks) and write it to ``DIR/<name>.pickle`` (``torch.cuda.memory._dump_snapshot``'s
    format: pytorch.org/memory_viz). Called after each step with the steps since the warmup ended."""
    import torch

    folder = os.environ.get("BENCH_MEMORY_SNAPSHOT")
    if not folder:
        return
    if step_after_warmup == 0:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    elif step_after_warmup == 1:
        Path(folder).mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(Path(folder) / f"{name}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)


def sync_audit_hook(step_after_warmup: int, name: str) -> None:
    """With ``BENCH_SYNC_AUDIT=DIR``: every call that makes the host wait for the device during the
    first measured step (``torch.cuda.set_sync_debug_mode``: .item(), blocking copies, nonzero...),
    counted by the Python frames that made it, written to ``DIR/<name>_syncs.txt``. Called after each
    step with the steps since the warmup ended."""
    import torch

    folder = os.environ.get("BENCH_SYNC_AUDIT")
    if not folder:
        return
    if step_after_warmup == 0:
        _SYNCS.clear()
        warnings.filterwarnings("always", message=".*synchronizing CUDA operation.*")
        shown = _SHOWWARNING[:] = [warnings.showwarning]

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchronizing CUDA operation" not in str(message):
                return shown[0](message, category, filename, lineno, file, line)
            frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
            mine = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames[-8:]]
            key = "\n    ".join(mine)
            _SYNCS[key] = _SYNCS.get(key, 0) + 1

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
    elif step_after_warmup == 1 and _SHOWWARNING:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = _SHOWWARNING.pop()
        counts = sorted(_SYNCS.items(), key=lambda kv: -kv[1])
        Path(folder).mkdir(parents=True, exist_ok=True)
        text = f"{sum(c for _, c in counts)} synchronizing calls in one step of {name}\n" + "".join(
            f"\n{c}x\n    {where}\n" for where, c in counts)
        (Path(folder) / f"{_label(name)}_syncs.txt").write_text(text)
        print(text, flush=True)


_SYNCS: dict[str, int] = {}  # the frames of a synchronizing call -> how often, in the audited step
_SHOWWARNING: list = []  # warnings.showwarning while the audit replaces it


def _label(name: str) -> str:
    """``name`` (the contender) and the workload it runs, for the files the hooks write."""
    return "_".join(part for part in (name, os.environ.get("BENCH_WORKLOAD")) if part)


class StepClock:
    """Times optimizer steps end to end and resets the peak-memory counter after the warmup.

    With ``profile_steps``, the steps after the measured ones run under the profiler (not
    timed): how long the device was busy (the union of its kernels and copies) per step,
    against the wall time of those steps. The rest of a step is the device waiting for the host.
    """

    def __init__(self, device: str, warmup: int, steps: int, profile_steps: int = 0, name: str = "run") -> None:
        self.device, self.warmup, self.steps, self.profile_steps = device, warmup, steps, profile_steps
        self.name = name
        self.ends: list[float] = []
        self.losses: list[Any] = []  # floats, or (BENCH_CLOCK=events) 0-d tensors read at the end
        # BENCH_CLOCK=events: a CUDA event at the end of each step, timed after the last one.
        self.events: Optional[list[Any]] = [] if device == "cuda" and os.environ.get("BENCH_CLOCK") == "events" else None
        self._profiler = None
        self.profile: Optional[dict[str, float]] = None

    @property
    def total(self) -> int:
        return self.warmup + self.steps + self.profile_steps

    def step_done(self, loss: Any = None) -> None:
        """The end of an optimizer step; ``loss``: its loss (a number, or a tensor read later)."""
        import torch

        profiled = self.profile_steps and len(self.ends) >= self.warmup + self.steps
        if self.events is not None and not profiled:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()
        else:
            _sync(self.device)
        self.ends.append(time.perf_counter())
        if loss is not None:
            self.losses.append(loss.detach() if self.events is not None and torch.is_tensor(loss) else float(loss))
        if len(self.ends) == self.warmup and self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if self.device == "cuda":
            memory_snapshot_hook(len(self.ends) - self.warmup, self.name)
            sync_audit_hook(len(self.ends) - self.warmup, self.name)
        if self.profile_steps and len(self.ends) == self.warmup + self.steps:
            _sync(self.device)  # (with BENCH_CLOCK=events the last timed step may still run)
            self._profiler = torch.profiler.profile(activities=profiler_activities(self.device))
            self._profiler.__enter__()
            self.ends.append(time.perf_counter())  # the profiler's start is not a step's time
        elif self._profiler is not None and len(self.ends) == self.warmup + self.steps + 1 + self.profile_steps:
            self._profiler.__exit__(None, None, None)
            wall = self.ends[-1] - self.ends[-1 - self.profile_steps]
            keep = None  # with BENCH_TRACE=DIR: the profiled steps' Chrome trace (ui.perfetto.dev), gzipped
            if os.environ.get("BENCH_TRACE"):
                Path(os.environ["BENCH_TRACE"]).mkdir(parents=True, exist_ok=True)
                keep = Path(os.environ["BENCH_TRACE"]) / f"{_label(self.name)}_trace.json.gz"
            self.profile = device_busy(self._profiler, wall, self.profile_steps, keep)
            self._profiler = None

    def result(self, name: str, tokens_per_step: int, flops_per_token: float) -> dict[str, Any]:
        import torch

        if self.events is not None:
            torch.cuda.synchronize()
            marks = self.events[self.warmup - 1:self.warmup + self.steps]
            times = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        else:
            timed = self.ends[self.warmup - 1:self.warmup + self.steps]
            times = [b - a for a, b in zip(timed, timed[1:])]
        return {
            "contender": name, "step_times": times, "tokens_per_step": tokens_per_step,
            "flops_per_token": flops_per_token, "losses": [float(loss) for loss in self.losses],
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if self.device == "cuda" else None,
            "profile": self.profile,
        }


def profiler_activities(device: str):
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]


DEVICE_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_busy(profiler, wall_s: float, steps: int, keep: Optional[Path] = None) -> dict[str, float]:
    """Per step: the wall time and the time the device ran anything (overlaps counted once).
    ``keep``: where the trace stays (a .gz name: gzipped), else it is read from a temporary file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = keep or Path(tmp) / "trace.json"
        profiler.export_chrome_trace(str(path))
        with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("ph") == "X" and e.get("cat") in DEVICE_EVENT_CATEGORIES)
    busy = union_length_us(spans) / 1e3 / steps if spans else None  # None: no device events (CPU)
    return {"wall_ms": 1e3 * wall_s / steps, "busy_ms": busy, **kernel_breakdown(events, steps),
            "host_top": host_breakdown(events, steps)}


def host_breakdown(events: list[dict[str, Any]], steps: int, top: int = 15) -> list[dict[str, Any]]:
    """Per step: the host calls that took longest in total (the CUDA runtime's included: a
    synchronize or a blocking copy there is where the host waited for the device)."""
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "python_function", "user_annotation"):
            entry = totals.setdefault(f'{e["cat"]}: {e.get("name", "?")[:80]}', [0.0, 0])
            entry[0] += e.get("dur", 0) / 1e3 / steps
            entry[1] += 1 / steps
    return [{"name": k, "ms": round(v[0], 3), "calls": round(v[1], 1)}
            for k, v in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]]


# Kernel families by name (first match wins): where a step's device time goes.
KERNEL_KINDS = (
    ("compiled (triton)", ("triton",)),
    ("grouped gemm", ("grouped", "group_gemm", "ragged", "groupproblemshape")),
    ("attention", ("flash", "fmha", "attention", "flex", "cudnn", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "matmul", "_mm_")),
    ("sort / scan / index", ("sort", "radix", "scan", "index", "scatter", "gather", "cumsum", "unique", "histogram",
                             "nonzero", "select")),
    ("reduction", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "fill", "copy")),
    ("memcpy / memset", ("memcpy", "memset")),
    ("collective", ("nccl",)),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in lowered for k in keys)), "other")


def kernel_breakdown(events: list[dict[str, Any]], steps: int, top: int = 12) -> dict[str, Any]:
    """Per step: device time and launches by kernel family, and the ``top`` kernels by time."""
    kinds: dict[str, list[float]] = {}
    kernels: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_EVENT_CATEGORIES:
            continue
        name = e.get("name", "?")
        for table, key in ((kinds, kernel_kind(name)), (kernels, name[:90])):
            entry = table.setdefault(key, [0.0, 0])
            entry[0] += e.get("dur", 0) / 1e3 / steps
            entry[1] += 1 / steps
    if not kernels:
        return {}
    ordered = lambda table, n=None: [{"name": k, "ms": round(v[0], 3), "launches": round(v[1], 1)}
                                     for k, v in sorted(table.items(), key=lambda kv: -kv[1][0])[:n]]
    return {"launches": round(sum(v[1] for v in kinds.values()), 1), "kinds": ordered(kinds),
            "top_kernels": ordered(kernels, top)}


def union_length_us(spans: list[tuple[float, float]]) -> float:
    """The total length of sorted (start, end) intervals, overlapping parts once."""
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _lightning_clock(clock: StepClock):
    import lightning as L

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = trainer.callback_metrics.get("train/loss")
            clock.step_done(loss)

    return Clock()


def run_titan(w: Workload, device: str, steps: int, warmup: int) -> dict[str, Any]:
    from titan_lightning.cli import prepare
    from titan_lightning.recipe import execute

    clock = StepClock(device, warmup, steps, w.profile_steps, name="titan")
    command, run, trainer = prepare(["fit", *cli_args(w, device, clock.total)])
    trainer.callbacks.append(_lightning_clock(clock))
    execute(command, run, trainer)
    t = run.job.training  # as built: a recipe may choose lengths for the device
    result = clock.result("titan", t.tokens_per_microbatch_per_dp_rank * trainer.accumulate_grad_batches,
                          run.module.flops_per_token(t.seq_len))
    return {**result, **_sft_shares(run)}


def _sft_shares(run) -> dict[str, Any]:
    """What share of a step's window tokens are conversation tokens (not padding) and supervised
    labels, over the windows the run's data makes (SFT only): real and supervised tokens/s."""
    job = run.job
    if not job.data.sft or job.preference.loss is not None:
        return {}
    from benchmarks.sft_data import window_stats

    stats = window_stats(Path(job.data.dataset_path), job.training.seq_len, job.data.sft_packing, 2000)
    return {"tokens_share": stats["tokens_share"], "supervised_share": stats["supervised_share"],
            "seq_len": job.training.seq_len, "packing": job.data.sft_packing}


def _build_model(run, device):
    """The module's model on the meta device, float8 (``quantize.float8``), AC and compile applied
    per block (TitanStrategy's calls, in its order), then materialized with the recipe's init; and
    the loss function."""
    import torch

    from titan_lightning.models.causal_lm import cross_entropy_loss
    from titan_lightning.parallel.activation_checkpoint import apply_activation_checkpointing
    from titan_lightning.parallel.compile import compile_blocks, compile_loss, moe_stays_eager
    from titan_lightning.parallel.float8 import convert_to_float8
    from titan_lightning.parallel.fsdp import model_blocks

    job = run.job
    with torch.device("meta"):
        model = run.module.build_model()
    if job.quantize.float8.enable:
        convert_to_float8(model, job.quantize.float8)
    blocks = model_blocks(model)
    if job.activation_checkpoint.mode != "none":
        apply_activation_checkpointing(blocks, job.activation_checkpoint.mode, job.activation_checkpoint.selective_ac_option)
    c = job.compile
    if c.enable and "model" in c.components:
        dtype = getattr(torch, job.training.mixed_precision_param)  # what the blocks compute in
        moe = "moe" in c.components and moe_stays_eager(model, device_type=device.type, dtype=dtype, tp=False,
                                                         ep_dispatch=None) is None
        compile_blocks(blocks, backend=c.backend, fullgraph=c.fullgraph, moe=moe)
    if job.training.loss_chunks is not None:  # the model returns hidden states; its head takes the labels
        def loss_fn(h, labels):
            return model.output(h, labels=labels, chunks=job.training.loss_chunks)
    elif c.enable and "loss" in c.components:
        loss_fn = compile_loss(cross_entropy_loss, backend=c.backend)
    else:
        loss_fn = cross_entropy_loss
    return model, blocks, loss_fn


def _init(model, job, device) -> None:
    import torch

    model.to(getattr(torch, job.training.dtype))
    model.to_empty(device=device)
    model.init_weights(job.training.seed)


def _train_loader(run):
    dm = run.datamodule
    dm.setup("fit")
    return dm.train_dataloader()


def run_bare(w: Workload, device: str, steps: int, warmup: int) -> dict[str, Any]:
    import torch

    from titan_lightning.models.common.moe import update_expert_bias
    from titan_lightning.optim import build_lr_scheduler, build_optimizer
    from titan_lightning.parallel.grad_norm import global_grad_norm

    clock = StepClock(device, warmup, steps, w.profile_steps, name="bare")
    total = clock.total
    run = resolve_run(w, device, total)
    job, dev = run.job, torch.device(device)
    torch.manual_seed(job.training.seed)
    model, _, loss_fn = _build_model(run, dev)
    _init(model, job, dev)
    optimizer = build_optimizer(model.parameters(), job.optimizer, dev)
    scheduler = build_lr_scheduler(optimizer, job.lr_schedule, total)
    autocast = job.training.mixed_precision_param == "bfloat16" and job.training.dtype == "float32"
    max_norm = job.training.max_grad_norm
    batches = iter(_train_loader(run))
    for _ in range(total):
        batch = next(batches)
        ids, labels = batch["input_ids"].to(dev, non_blocking=True), batch["labels"].to(dev, non_blocking=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            logits = model(ids)  # (hidden states with training.loss_chunks: the head runs in the loss)
            loss = loss_fn(logits, labels) if job.training.loss_chunks is not None else None
        if loss is None:
            loss = loss_fn(logits, labels)
        del logits  # not kept through the backward (2 GiB of bf16 logits at 128k vocab, seq 8192)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = global_grad_norm(grads)
        if max_norm is not None:
            coefficient = min(max_norm / (norm.item() + 1e-6), 1.0)
            if coefficient < 1.0:
                torch._foreach_mul_(grads, coefficient)
        del grads  # else last step's gradients stay alive through the next forward and backward
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        update_expert_bias(model)  # MoE load balancing, as the module's optimizer_step does
        clock.step_done(loss.detach())
    return clock.result("bare", w.seq_len, run.module.flops_per_token(w.seq_len))


def run_lightning(w: Workload, device: str, steps: int, warmup: int) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from titan_lightning.optim import build_lr_scheduler, build_optimizer

    clock = StepClock(device, warmup, steps, w.profile_steps, name="lightning")
    total = clock.total
    run = resolve_run(w, device, total)
    job = run.job

    class Module(L.LightningModule):
        """What a user of ModelParallelStrategy writes: FSDP2 in configure_model."""

        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            model, blocks, self.loss_fn = _build_model(run, self.device)
            mesh = self.device_mesh["data_parallel"]
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in blocks:
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            _init(model, job, self.device)
            self.model = model

        def training_step(self, batch, batch_idx):
            loss = self.loss_fn(self.model(batch["input_ids"]), batch["labels"])
            self.log("train/loss", loss.detach())
            return loss

        def configure_optimizers(self):
            optimizer = build_optimizer(self.model.parameters(), job.optimizer, self.device)
            scheduler = build_lr_scheduler(optimizer, job.lr_schedule, total)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    torch.manual_seed(job.training.seed)
    folder = tempfile.mkdtemp(prefix="bench_lightning_")
    trainer = L.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=total, limit_val_batches=0,
        enable_checkpointing=False, gradient_clip_val=job.training.max_grad_norm, log_every_n_steps=10,
        default_root_dir=folder, callbacks=[_lightning_clock(clock)], enable_progress_bar=True,
    )
    module = Module()
    trainer.fit(module, datamodule=run.datamodule)
    return clock.result("lightning", w.seq_len, run.module.flops_per_token(w.seq_len))


def hf_model(job, device):
    """transformers' model of the job's shape (untied embeddings, as ours), fp32 weights: Llama,
    Qwen 3 MoE, or DeepSeek V3 (the config.json our export writes)."""
    import inspect

    import torch
    import transformers

    a = job.model
    if hasattr(a, "kv_lora_rank"):  # DeepSeek V3 (MLA): the config an export writes
        from titan_lightning.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

        fields = {k: v for k, v in DeepSeekV3StateDictAdapter.hf_config(a).items()
                  if k not in ("architectures", "model_type")}
        fields.update(tie_word_embeddings=False, attn_implementation="sdpa")
        with torch.device(device):
            return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**fields))
    common = dict(vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.ffn_hidden_dim,
                  num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads,
                  max_position_embeddings=max(job.training.seq_len, getattr(a, "max_seq_len", 0)),
                  rms_norm_eps=a.norm_eps, tie_word_embeddings=False, attn_implementation="sdpa")
    if hasattr(a, "moe") and a.moe is not None:
        config_cls, model_cls = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
        rope = {"rope_type": "default"}
        common.update(head_dim=a.head_dim, num_experts=a.moe.num_experts, num_experts_per_tok=a.moe.top_k,
                      moe_intermediate_size=a.moe.hidden_dim, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[])
    else:
        config_cls, model_cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
        s = a.rope_scaling
        rope = {"rope_type": "default"} if s is None else {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    if "rope_parameters" in inspect.signature(config_cls).parameters:  # transformers 5
        common["rope_parameters"] = {**rope, "rope_theta": a.rope_theta}
    else:
        common.update(rope_theta=a.rope_theta, rope_scaling=None if rope["rope_type"] == "default" else rope)
    with torch.device(device):
        return model_cls(config_cls(**common))


def run_hf(w: Workload, device: str, steps: int, warmup: int) -> dict[str, Any]:
    import torch

    clock = StepClock(device, warmup, steps, w.profile_steps, name="hf")
    total = clock.total
    run = resolve_run(w, device, total)
    job, dev = run.job, torch.device(device)
    torch.manual_seed(job.training.seed)
    model = hf_model(job, dev)
    if w.hf_ac:
        model.gradient_checkpointing_enable()
    model.train()
    o = job.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, fused=True)
    batches = iter(_train_loader(run))
    for _ in range(total):
        ids = next(batches)["input_ids"].to(dev, non_blocking=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.training.max_grad_norm or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.step_done(loss.detach())
    return clock.result("hf", w.seq_len, run.module.flops_per_token(w.seq_len))


def _hf_sft_loop(w: Workload, device: str, steps: int, warmup: int, packing: str) -> dict[str, Any]:
    """transformers' model of the workload's folder (``AutoModelForCausalLM``, SDPA, fp32 weights, bf16
    autocast, fused AdamW, clipping; no compile, no AC) in a plain loop on the same prepared
    conversations, as TRL's SFTTrainer feeds it without flash-attn: ``padded``, one conversation per row
    padded to the batch's longest with an attention mask; ``best_fit``, our packed windows with
    per-conversation position_ids and no mask (transformers' SDPA path masks packed sequences from
    them). Rows of the workload's seq_len, as many per step as titan's microbatch; the loss is the mean
    over the microbatch's supervised tokens (TRL's)."""
    import torch
    import torch.nn.functional as F
    import transformers

    from benchmarks.finetune_folder import folders
    from titan_lightning.models.common.loss import IGNORE_INDEX

    name = "hf_padded" if packing == "padded" else "hf_packed"
    clock = StepClock(device, warmup, steps, w.profile_steps, name=name)
    total = clock.total
    run = resolve_run(w, device, total)
    job, dev = run.job, torch.device(device)
    job.data.sft_packing = packing
    torch.manual_seed(job.training.seed)
    lora = job.lora
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folders(*w.folder)[0], dtype=torch.bfloat16 if lora.enabled else torch.float32,
        attn_implementation="sdpa").to(dev)
    if w.hf_ac:
        model.gradient_checkpointing_enable()
        if lora.enabled:
            model.enable_input_require_grads()  # (checkpointed blocks of a frozen base need a grad input)
    if lora.enabled:  # transformers + peft: the frozen base in bf16, PEFT's adapters (fp32) on the same linears
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                           target_modules=lora.target_modules if lora.target_modules
                                                           != ["all-linear"] else "all-linear"))
    model.train()
    o = job.optimizer
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr, betas=(o.beta1, o.beta2),
                                  eps=o.eps, weight_decay=o.weight_decay, fused=dev.type == "cuda")
    batches = iter(_train_loader(run))
    window = real = supervised = 0
    for step in range(total):
        batch = next(batches)
        positions = batch["position_ids"]
        ids, labels = batch["input_ids"].to(dev, non_blocking=True), batch["labels"].to(dev, non_blocking=True)
        if packing == "padded":  # a row's padding starts where its positions return to 0
            starts = positions == 0
            starts[:, 0] = False
            keep = starts.cumsum(1) == 0
            inputs = {"attention_mask": keep.long().to(dev, non_blocking=True)}
        else:
            keep = torch.ones_like(positions, dtype=torch.bool)  # (best_fit: padding is < 1%; counted below)
            inputs = {"position_ids": positions.to(dev, non_blocking=True)}
        if step >= warmup and step < warmup + steps:
            window += positions.numel()
            real += int(keep.sum())
            supervised += int((batch["labels"] != IGNORE_INDEX).sum())
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(input_ids=ids, **inputs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        del logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.training.max_grad_norm or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.step_done(loss.detach())
    result = clock.result(name, window // steps, run.module.flops_per_token(job.training.seq_len))
    shares = _sft_shares(run) if packing != "padded" else {}
    return {**result, "tokens_share": shares.get("tokens_share", real / window),
            "supervised_share": supervised / window, "seq_len": job.training.seq_len, "packing": packing}


def run_hf_padded(w: Workload, device: str, steps: int, warmup: int) -> dict[str, Any]:
    return _hf_sft_loop(w, device, steps, warmup, "padded")


def run_hf_packed(w: Workload, device: str, steps: int, warmup: int) -> dict[str, Any]:
    return _hf_sft_loop(w, device, steps, warmup, "best_fit")


def run_trl(w: Workload, device: str, steps: int, warmup: int) -> dict[str, Any]:
    """TRL's SFTTrainer itself on the workload's folder and the same prepared conversations: each
    conversation one row (``input_ids`` and ``assistant_masks`` from our shards, so both train on the
    same tokens and supervise the same ones: TRL builds its labels from ``assistant_masks``), padded per batch to its
    longest row as TRL's collator pads (no packing: TRL's packing needs flash-attn's varlen path),
    bf16 autocast over fp32 weights, fused AdamW, the workload's rows per step; no compile, no AC
    unless the workload asks. Window tokens count the padded batch; real tokens its attention mask."""
    import datasets
    import torch
    import transformers
    import trl

    from benchmarks.finetune_folder import folders
    from titan_lightning.models.common.loss import IGNORE_INDEX

    clock = StepClock(device, warmup, steps, w.profile_steps, name="trl")
    total = clock.total
    run = resolve_run(w, device, total)
    job = run.job
    job.data.sft_packing = "padded"  # one conversation a window: the rows TRL trains on
    rows: dict[str, list[list[int]]] = {"input_ids": [], "assistant_masks": []}
    loader = iter(_train_loader(run))
    rows_per_step = job.training.microbatch_size
    while len(rows["input_ids"]) < total * rows_per_step:
        batch = next(loader)
        for ids, labels, positions in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
            ends = (positions[1:] == 0).nonzero()
            n = int(ends[0]) + 1 if len(ends) else len(ids)  # padding starts where positions return to 0
            supervised = (labels[: n - 1] != IGNORE_INDEX).long().tolist()
            rows["input_ids"].append(ids[:n].tolist())
            rows["assistant_masks"].append([0] + supervised)  # token t is a target when labels[t - 1] is
    folder = folders(*w.folder)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    o = job.optimizer
    config = trl.SFTConfig(
        output_dir=str(Path(tempfile.mkdtemp(prefix="trl_bench_"))), max_steps=total, per_device_train_batch_size=rows_per_step,
        gradient_accumulation_steps=1, learning_rate=o.lr, adam_beta1=o.beta1, adam_beta2=o.beta2, adam_epsilon=o.eps,
        weight_decay=o.weight_decay, max_grad_norm=job.training.max_grad_norm or 0.0, lr_scheduler_type="constant",
        optim="adamw_torch_fused" if device == "cuda" else "adamw_torch", bf16=device == "cuda",
        use_cpu=device != "cuda", max_length=job.training.seq_len, packing=False,
        gradient_checkpointing=bool(w.hf_ac), logging_steps=1, save_strategy="no", report_to="none",
        dataloader_num_workers=0, seed=job.training.seed, disable_tqdm=True)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_dict(rows),
                             processing_class=tokenizer)
    counts = {"window": 0, "real": 0, "supervised": 0, "batches": 0}
    collate = trainer.data_collator

    def counted(features):
        out = collate(features)
        counts["batches"] += 1
        if warmup < counts["batches"] <= warmup + steps:
            counts["window"] += out["input_ids"].numel()
            counts["real"] += int(out["attention_mask"].sum()) if "attention_mask" in out else out["input_ids"].numel()
            counts["supervised"] += int((out["labels"] != -100).sum())
        return out

    trainer.data_collator = counted

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.step_done()

    trainer.add_callback(Clock())
    trainer.train()
    window = max(1, counts["window"])
    result = clock.result("trl", window // steps, run.module.flops_per_token(job.training.seq_len))
    result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {**result, "tokens_share": counts["real"] / window, "supervised_share": counts["supervised"] / window,
            "seq_len": job.training.seq_len, "packing": "padded (TRL)"}


TORCHTITAN_SCRIPT = REPO / "benchmarks" / "contenders" / "torchtitan_run.py"


def _torchtitan_moe(m) -> dict[str, Any]:
    """torchtitan's MoEArgs fields for our MoE: the same router (scores, normalization, groups,
    expert bias for load balancing) and grouped GEMM experts."""
    return dict(num_experts=m.num_experts, num_shared_experts=m.num_shared_experts, score_func=m.score_func,
                route_norm=m.route_norm, route_scale=m.route_scale, gate_bias=False,
                score_before_experts=m.score_before_experts, top_k=m.top_k,
                num_expert_groups=None if m.num_groups == 1 else m.num_groups,
                num_limited_groups=None if m.num_groups == 1 else m.top_k_groups,
                use_grouped_mm=m.use_grouped_mm is not False, load_balance_coeff=m.load_balance_coeff)


def torchtitan_model(a, seq_len: int) -> tuple[str, dict[str, Any]]:
    """torchtitan's model name and ModelArgs fields for our model args ``a`` (Llama 3, Qwen 3 dense
    or MoE, DeepSeek V3); what torchtitan's model cannot express raises ValueError naming the field."""
    from titan_lightning.models.deepseek_v3.model import DeepSeekV3Args
    from titan_lightning.models.llama3.model import Llama3Args
    from titan_lightning.models.qwen3.model import Qwen3Args

    unsupported = {f"model.{k}": getattr(a, k) for k, ok in (("attention", "sdpa"), ("mask", "causal"),
                                                          ("positions", "global")) if getattr(a, k, ok) != ok}
    for field in ("ffn_dim", "latent_norm_eps", "token_group_align"):
        value = getattr(a, field, None) if field != "token_group_align" else getattr(getattr(a, "moe", None), field, None)
        if value is not None:
            unsupported[f"model.{field}"] = value
    if unsupported or not isinstance(a, (Llama3Args, Qwen3Args, DeepSeekV3Args)):
        what = ", ".join(f"{k}={v!r}" for k, v in unsupported.items()) or type(a).__name__
        raise ValueError(f"torchtitan's runner cannot build {what} (Llama 3, Qwen 3, DeepSeek V3 with SDPA, causal)")
    common = dict(dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, vocab_size=a.vocab_size, norm_eps=a.norm_eps,
                  rope_theta=a.rope_theta, max_seq_len=seq_len, attn_type="sdpa", attn_mask_type="causal")
    if isinstance(a, Llama3Args):
        s = a.rope_scaling  # torchtitan always scales: factor 1 is plain RoPE
        scaling = dict(scaling_factor=1.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192) if s is None else dict(
            scaling_factor=s.factor, low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings)
        return "llama3", dict(common, n_kv_heads=a.n_kv_heads, multiple_of=a.multiple_of,
                              ffn_dim_multiplier=a.ffn_dim_multiplier, rope_scaling_args=scaling,
                              depth_init=a.depth_init)
    if isinstance(a, Qwen3Args):
        moe = {} if a.moe is None else dict(moe_enabled=True, moe_inter_dim=a.moe.hidden_dim,
                                            moe_args=_torchtitan_moe(a.moe))
        return "qwen3", dict(common, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, hidden_dim=a.ffn_hidden_dim,
                             qk_norm=a.qk_norm, depth_init=a.depth_init, enable_weight_tying=False, **moe)
    return "deepseek_v3", dict(common, inter_dim=a.inter_dim, moe_inter_dim=a.moe.hidden_dim,
                               n_dense_layers=a.n_dense_layers, moe_args=_torchtitan_moe(a.moe),
                               q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
                               qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
                               v_head_dim=a.v_head_dim, original_seq_len=a.original_seq_len, rope_factor=a.rope_factor,
                               beta_fast=a.beta_fast, beta_slow=a.beta_slow, mscale=a.mscale)


def torchtitan_workload(w: Workload, device: str) -> dict[str, Any]:
    """The workload torchtitan's runner trains (benchmarks/contenders/torchtitan_run.py, its
    ``WORKLOAD_KEYS``): the titan row's resolved job (model, step, optimizer, schedule, AC,
    compile, float8) and the files its data module reads (the shipped corpus and tokenizer by
    default). What the runner cannot express raises ValueError naming the field."""
    from titan_lightning.data.tokenizer import CORPUS_PATH, shipped_asset, tokenizer_file

    run = resolve_run(w, device, 1)
    job = run.job
    data, o, t, f8 = job.data, job.optimizer, job.training, job.quantize.float8
    model, model_args = torchtitan_model(job.model, t.seq_len)
    unsupported = {"training.loss_chunks": t.loss_chunks, "data.sources": data.sources or None,
                   "quantize.float8.min_dim": f8.min_dim if f8.enable and f8.min_dim else None}
    unsupported = {k: v for k, v in unsupported.items() if v is not None}
    if unsupported:
        raise ValueError("torchtitan's runner cannot train " + ", ".join(f"{k}={v!r}" for k, v in unsupported.items()))
    tokenizer = tokenizer_file(data.tokenizer_path)
    if tokenizer.name != "tokenizer.json":
        raise ValueError(f"data.tokenizer_path={data.tokenizer_path!r}: torchtitan reads a folder's tokenizer.json")
    corpus = shipped_asset(CORPUS_PATH) if data.dataset_path is None else Path(data.dataset_path)
    if not corpus.is_file():
        raise ValueError(f"data.dataset_path={data.dataset_path!r}: torchtitan's runner reads one text file")
    ac, c = job.activation_checkpoint, job.compile
    return dict(
        model=model, model_args=model_args,
        seq_len=t.seq_len, batch=t.tokens_per_microbatch_per_dp_rank // t.seq_len, training_dtype=t.dtype,
        mixed_precision_param=t.mixed_precision_param,
        lr=o.lr, beta1=o.beta1, beta2=o.beta2, eps=o.eps, weight_decay=o.weight_decay, max_norm=t.max_grad_norm,
        warmup_steps=job.lr_schedule.warmup_steps, decay_ratio=job.lr_schedule.decay_ratio,
        decay_type=job.lr_schedule.decay_type, min_lr_factor=job.lr_schedule.min_lr_factor, seed=t.seed,
        compile=c.enable, compile_components=[n for n in c.components if n in ("model", "loss")],
        # torchtitan's "op" is our "op_lean" (every second matmul recomputed); ours "op" saves every matmul
        ac=ac.mode, ac_option="op" if ac.selective_ac_option in ("op", "op_lean") else str(ac.selective_ac_option),
        float8=dict(recipe=f8.recipe, filter_fqns=list(f8.filter_fqns), emulate=f8.emulate) if f8.enable else None,
        dataset_path=str(corpus), tokenizer_path=str(tokenizer.parent),
    )


def flops_per_token(w: Workload, device: str) -> float:
    """The training FLOPs per token of the workload's model (the same formula for every contender)."""
    return resolve_run(w, device, 1).module.flops_per_token(w.seq_len)


RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "titan": run_titan, "bare": run_bare, "lightning": run_lightning, "hf": run_hf,
    "hf_padded": run_hf_padded, "hf_packed": run_hf_packed, "trl": run_trl,
}


# -- the orchestra ---------------------------------------------------------------------------


def _contender_command(name: str, workload: str, args, result: Path) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if name == "torchtitan":
        w = _workload(workload, args.layers, args.ac)
        spec = torchtitan_workload(w, args.device)
        site = os.environ.get("TORCHTITAN_SITE", "/tmp/ttsite")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
        return ([sys.executable, str(TORCHTITAN_SCRIPT), "--workload",
                 json.dumps(spec), "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(result)], env)
    command = [sys.executable, "-m", "benchmarks.throughput", "--contender", name, "--workload", workload,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device, "--result", str(result)]
    if args.layers is not None:
        command += ["--layers", str(args.layers)]
    if args.ac is not None:
        command += ["--ac", args.ac]
    if args.profile_steps:
        command += ["--profile-steps", str(args.profile_steps)]
    return command + ["--sdpa", args.sdpa], env


SDPA_BACKENDS = ("default", "flash", "cudnn", "efficient", "math")


def use_sdpa_backend(name: str) -> None:
    """Leave SDPA one kernel (an experiment: cuDNN attention is FlashAttention-3-class on Hopper)."""
    if name == "default":
        return
    import torch

    b = torch.backends.cuda
    for backend, enable in (("flash", b.enable_flash_sdp), ("cudnn", b.enable_cudnn_sdp),
                            ("efficient", b.enable_mem_efficient_sdp), ("math", b.enable_math_sdp)):
        enable(backend == name)


def _workload(name: str, layers: Optional[int], ac: Optional[str] = None, profile_steps: int = 0) -> Workload:
    w = dataclasses.replace(WORKLOADS[name], profile_steps=profile_steps)
    if layers is not None:
        w.layers = layers
    if ac is not None:
        w.ac = ac
    return w


def run_contender_process(name: str, workload: str, args, folder: Path, round_index: int) -> dict[str, Any]:
    stem = f"{name}_round{round_index}" if workload == args.workload else f"{name}_{workload}_round{round_index}"
    result, log = folder / f"{stem}.json", folder / f"{stem}.log"
    command, env = _contender_command(name, workload, args, result)
    start = time.perf_counter()
    with open(log, "w") as out:
        try:
            proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                  timeout=args.timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.perf_counter() - start
    if result.exists():
        data = json.loads(result.read_text())
    else:
        data = {"contender": name, "error": f"exit {code}: {_last_error_line(log)}"}
    data["wall_s"] = wall
    if name == "torchtitan" and "error" not in data:
        # The same FLOPs formula for every contender: torchtitan's runner trains our shape.
        data["flops_per_token"] = flops_per_token(_workload(workload, args.layers, args.ac), args.device)
    return data


def _last_error_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def summarize(runs: list[dict[str, Any]], peak: Optional[float]) -> dict[str, Any]:
    """One row: tokens/s per device from the median step, the spread of the rounds' medians."""
    ok = [r for r in runs if "error" not in r and r.get("step_times")]
    if not ok:
        return {"error": runs[0].get("error", "no steps") if runs else "not run"}
    times = [t for r in ok for t in r["step_times"]]
    tokens, flops = ok[0]["tokens_per_step"], ok[0].get("flops_per_token")
    median = statistics.median(times)
    round_rates = [tokens / statistics.median(r["step_times"]) for r in ok]
    peaks = [r["peak_memory_bytes"] for r in ok if r.get("peak_memory_bytes")]
    row = {
        "tokens_per_s": tokens / median, "round_min": min(round_rates), "round_max": max(round_rates),
        "step_ms_median": 1e3 * median, "step_ms_p10": 1e3 * _quantile(times, 0.1),
        "step_ms_p90": 1e3 * _quantile(times, 0.9), "steps": len(times), "rounds": len(ok),
        "peak_gib": max(peaks) / 2**30 if peaks else None,
        "mfu": 100.0 * tokens / median * flops / peak if peak and flops else None,
        "first_loss": ok[0]["losses"][0] if ok[0].get("losses") else None,
        "last_loss": ok[0]["losses"][-1] if ok[0].get("losses") else None,
        "wall_s": [round(r["wall_s"]) for r in runs],
    }
    for key in ("tokens_share", "supervised_share", "seq_len", "packing"):  # SFT rows
        if key in ok[0]:
            row[key] = ok[0][key]
    profiled = [r["profile"] for r in ok if r.get("profile") and r["profile"]["busy_ms"] is not None]
    if profiled:
        row["profile_wall_ms"] = statistics.median(p["wall_ms"] for p in profiled)
        row["device_busy_ms"] = statistics.median(p["busy_ms"] for p in profiled)
        row["kernels"] = {k: profiled[0][k] for k in ("launches", "kinds", "top_kernels") if k in profiled[0]}
    failed = [r["error"] for r in runs if "error" in r]
    if failed:
        row["failed_rounds"] = failed
    return row


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def table(rows: dict[str, dict[str, Any]], references: Optional[dict[str, str]] = None) -> str:
    """One line per row; "vs" divides its tokens/s by those of ``references[row]`` (each workload's own
    bare loop, or the row ``--reference`` names); SFT rows add real (conversation) and supervised tokens/s."""
    references = references or {}
    profiled = any("device_busy_ms" in r for r in rows.values())
    sft = any("tokens_share" in r for r in rows.values())
    extra = (" real tokens/s | supervised tokens/s |" if sft else "") + (
        " device busy ms / profiled step ms |" if profiled else "")
    lines = [
        "| contender | tokens/s/device | rounds (min-max) | vs | MFU % | step ms median (p10-p90) | peak GiB | loss first -> last |"
        + extra,
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if sft else "") + ("---|" if profiled else ""),
    ]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | |" + (" | |" if sft else "")
                         + (" |" if profiled else ""))
            continue
        reference = references.get(name)
        base = rows.get(reference, {}).get("tokens_per_s") if reference else None
        vs = f"{r['tokens_per_s'] / base:.3f}x {_short(reference)}" if base and reference != name else "-"
        mfu = f"{r['mfu']:.1f}" if r["mfu"] is not None else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        loss = f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}" if r["first_loss"] is not None else "-"
        shares = ""
        if sft:
            shares = (f" {r['tokens_per_s'] * r['tokens_share']:,.0f} | {r['tokens_per_s'] * r['supervised_share']:,.0f} |"
                      if "tokens_share" in r else " - | - |")
        lines.append(
            f"| {name} | {r['tokens_per_s']:,.0f} | {r['round_min']:,.0f}-{r['round_max']:,.0f} | {vs} | {mfu} | "
            f"{r['step_ms_median']:.1f} ({r['step_ms_p10']:.1f}-{r['step_ms_p90']:.1f}) | {peak} | {loss} |"
            + shares + (_busy_cell(r) if profiled else "")
        )
    return "\n".join(lines)


def _short(reference: str) -> str:
    """The reference row's contender, as the "vs" column names it (``bare`` of ``bare (llama3_1b)``)."""
    return reference.split(" (")[0]


def references_of(pairs: list[tuple[str, str]], row: Callable[[str, str], str], reference: str) -> dict[str, str]:
    """Each row's reference row: ``reference`` "bare" is each workload's own bare loop (a workload
    without one has none); another value names one row for all (``titan (qwen2_5_1_5b_sft_tuned)``)."""
    if reference != "bare":
        return {row(wl, n): reference for wl, n in pairs}
    return {row(wl, n): row(wl, "bare") for wl, n in pairs if (wl, "bare") in pairs}


def kernel_table(rows: dict[str, dict[str, Any]]) -> str:
    """One line per (row, kernel family), then each row's top kernels: the per-kernel breakdown."""
    lines = []
    for name, r in rows.items():
        k = r.get("kernels")
        if not k:
            continue
        lines.append(f"{name}: {k['launches']:.0f} launches per step")
        lines += [f"  {e['name']:<22} {e['ms']:8.2f} ms {e['launches']:7.0f}" for e in k["kinds"]]
        lines += [f"    top: {e['ms']:8.2f} ms {e['launches']:5.0f}x {e['name']}" for e in k["top_kernels"]]
    return "\n".join(lines)


def _busy_cell(r: dict[str, Any]) -> str:
    if "device_busy_ms" not in r:
        return " - |"
    busy, wall = r["device_busy_ms"], r["profile_wall_ms"]
    return f" {busy:.1f} / {wall:.1f} ({100 * busy / wall:.0f}%) |"


def environment(device: str) -> dict[str, str]:
    import lightning
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    env["device"] = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    return env


def device_peak(device: str) -> Optional[float]:
    if device != "cuda":
        return None
    import torch

    from titan_lightning.callbacks.metrics import peak_flops

    return peak_flops(torch.cuda.get_device_name())


def orchestrate(args) -> int:
    """Every contender of every workload of ``args.workload`` (comma-separated: rows side by side,
    e.g. bf16 and float8), ``args.rounds`` times in alternating order; prints the table."""
    names = [n for n in args.contenders.split(",") if n]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        print(f"--contenders: unknown {', '.join(unknown)}; valid: {', '.join(CONTENDERS)}", file=sys.stderr)
        return 2
    workloads = args.workload.split(",")
    # (workload, contender) pairs; a workload's own list says who can run it (float8: ours only).
    pairs = [(wl, n) for wl in workloads for n in names if n in _workload(wl, args.layers, args.ac).contenders]
    for wl in workloads:
        skipped = [n for n in names if (wl, n) not in pairs]
        if skipped:
            print(f"[{wl}] not run by {', '.join(skipped)} (not contenders of this workload)", flush=True)
    for wl in workloads:  # fine-tuning rows: their model folder and chat set, made once per machine
        w = _workload(wl, args.layers, args.ac)
        if w.folder is not None:
            from benchmarks.finetune_folder import make
            from benchmarks.preference_pairs import make_pairs

            (make_pairs if w.pairs else make)(*w.folder)
    folder = Path(args.out or tempfile.mkdtemp(prefix=f"throughput_{workloads[0]}_"))
    folder.mkdir(parents=True, exist_ok=True)
    row = (lambda wl, n: n) if len(workloads) == 1 else (lambda wl, n: f"{n} ({wl})")
    runs: dict[str, list[dict[str, Any]]] = {row(wl, n): [] for wl, n in pairs}
    for r in range(args.rounds):
        for wl, name in (pairs if r % 2 == 0 else pairs[::-1]):
            data = run_contender_process(name, wl, args, folder, r)
            runs[row(wl, name)].append(data)
            status = data.get("error") or f"{len(data['step_times'])} steps, median {statistics.median(data['step_times']):.3f} s"
            print(f"[round {r}] {row(wl, name)}: {status} ({data['wall_s']:.0f} s)", flush=True)
    peak = device_peak(args.device)
    rows = {key: summarize(value, peak) for key, value in runs.items()}
    headers = []
    for wl in workloads:
        w = _workload(wl, args.layers, args.ac)
        headers.append(f"workload {wl} ({w.recipe}, seq {w.seq_len}, batch 1, layers {w.layers or 'all'}, "
                       f"compile {w.compile}, AC {w.ac}{', ' + ' '.join(w.overrides) if w.overrides else ''})")
    header = ("\n".join(headers) + f"\n{args.steps} steps x {args.rounds} rounds after {args.warmup} warmup"
              + ("" if args.sdpa == "default" else f", SDPA {args.sdpa} only (torchtitan: default)"))
    env = environment(args.device)
    print("\n" + header + "\n" + ", ".join(f"{k} {v}" for k, v in env.items()) + "\n\n"
          + table(rows, references_of(pairs, row, args.reference)))
    breakdown = kernel_table(rows)
    if breakdown:
        print("\nper profiled step, device time by kernel family (ms, launches):\n" + breakdown)
    (folder / "summary.json").write_text(json.dumps({"workload": args.workload, "header": header, "environment": env,
                                                    "rows": rows, "runs": runs}, indent=1))
    print(f"\nper-round results and logs: {folder}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="llama3_1b",
                        help=f"one of {', '.join(sorted(WORKLOADS))}, or several, comma-separated (rows side by side)")
    parser.add_argument("--layers", type=int, default=None, help="override the workload's layer count")
    parser.add_argument("--ac", choices=("none", "selective", "full"), default=None,
                        help="override the workload's activation checkpointing (every contender that has one)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="steps traced after the measured ones: the device's busy time per step")
    parser.add_argument("--contenders", default=None, help=f"comma-separated subset of {','.join(CONTENDERS)}")
    parser.add_argument("--steps", type=int, default=15, help="measured steps per contender and round")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped first (compilation)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per contender process")
    parser.add_argument("--out", default=None, help="folder for per-round JSON and logs")
    parser.add_argument("--sdpa", choices=SDPA_BACKENDS, default="default",
                        help="the only attention kernel SDPA may pick, in every contender but torchtitan")
    parser.add_argument("--reference", default="bare",
                        help="the row the 'vs' column divides by: 'bare' (each workload's own bare loop) or a row's "
                             "name as the table prints it, e.g. 'titan (qwen2_5_1_5b_sft_tuned)'")
    parser.add_argument("--contender", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error(f"--warmup={args.warmup} and --steps={args.steps} must be >= 1")
    if args.profile_steps < 0:
        parser.error(f"--profile-steps={args.profile_steps} must be >= 0")
    unknown = [wl for wl in args.workload.split(",") if wl not in WORKLOADS]
    if unknown or (args.contender and "," in args.workload):
        problem = "unknown " + ", ".join(unknown) if unknown else "one per contender"
        parser.error(f"--workload={args.workload!r}: {problem}; valid: {', '.join(sorted(WORKLOADS))}")
    if args.contender:
        os.environ["BENCH_WORKLOAD"] = args.workload  # (names the files the hooks write)
        use_sdpa_backend(args.sdpa)
        w = _workload(args.workload, args.layers, args.ac, args.profile_steps)
        data = RUNNERS[args.contender](w, args.device, args.steps, args.warmup)
        Path(args.result).write_text(json.dumps(data))
        return 0
    if args.contenders is None:
        args.contenders = ",".join(dict.fromkeys(n for wl in args.workload.split(",")
                                                 for n in _workload(wl, args.layers, args.ac).contenders))
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
