#!/usr/bin/env bash
# The H200 measurements the open fine-tuning issues still owe (#44, #48, #49), in four parts that
# each fit one call of the device tool (< 10 minutes on a warm machine, folders made on the way).
# Output goes to files, never through a pipe (a killed run's compile workers would hold the pipe
# open), each step under its own `timeout -k`; the tables and logs land in $OUT (or /tmp/h200).
#
#   bash benchmarks/h200_owed.sh 1   # #44: the SFT step's synchronizations, SFT vs pretraining; 8B-shaped default vs tuned
#   bash benchmarks/h200_owed.sh 2   # #48: LoRA 8B profiled next to PEFT (the 1.5x bar)
#   bash benchmarks/h200_owed.sh 2b  # #48: LoRA 8B over float8 bases; QLoRA 8B (its peak memory)
#   bash benchmarks/h200_owed.sh 6   # #48: PEFT with gradient checkpointing (the issue's reference row)
#   bash benchmarks/h200_owed.sh 3   # #44: SFT (head on the labelled rows) vs pretraining, quiet and event-timed
#   bash benchmarks/h200_owed.sh 7   # #49: DPO per reference mode (frozen, LoRA adapters off), same folder
#   bash benchmarks/h200_owed.sh 8   # #49: the 8B shape (16 layers): SFT, DPO per reference mode
#   bash benchmarks/h200_owed.sh 5   # the GPU tests of LoRA and DPO
#   bash benchmarks/h200_owed.sh 9   # the GPU tests of the device defaults (#44's)
#   bash benchmarks/h200_owed.sh 4   # #48: QLoRA of the 70B shape (its blocks' memory, then the row)
#   bash benchmarks/h200_owed.sh 10  # compiled full checkpointing's memory per block, 8B shape (run 7's question)
#   bash benchmarks/h200_owed.sh 11  # #48: LoRA 8B +- AC against PEFT +- checkpointing, QLoRA 8B +- full AC, one run
#   bash benchmarks/h200_owed.sh 12  # run 9's questions: QLoRA 8B's peak without AC, LoRA 8B's step profiled
#   bash benchmarks/h200_owed.sh 13  # #48 after run 9's fixes: LoRA 8B vs PEFT (+ norm A/B), full-AC LoRA vs PEFT+GC, QLoRA 8B
#
# When machines are scarce (a start can fail and costs minutes), one machine runs the parts back to
# back in the background and each device call only waits for the next part to end:
#   bash benchmarks/h200_owed.sh chain 2 8 4 2b 5 6   # returns at once; parts run in that order
# (part 8, full fine-tuning of the 16-layer 8B shape, needs an H200's memory; the rest fits an H100)
#   bash benchmarks/h200_owed.sh wait 2 580        # waits (<= 580 s) for part 2, prints it, files to $OUT
# (the machine must stay held: the next call has to come within its idle time, or the chain is lost).
# The float8 and QLoRA rows (parts 2b, 4, 5) need torchao on the device: carry its wheel in .whl/
# (pip download --no-deps torchao==0.17.0 --python-version 3.12 --only-binary=:all: --platform
# manylinux_2_28_x86_64 -d .whl); run 5 lost those rows without it.
set -u
OUT=${OUT:-/tmp/h200}
mkdir -p "$OUT"
export TITAN_FT_BENCH=${TITAN_FT_BENCH:-/tmp/ftb} PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }

bench() {  # bench NAME SECONDS ARGS...: one benchmarks.throughput call, its table printed
  local name=$1 seconds=$2; shift 2
  timeout -k 5 "$seconds" python3 -m benchmarks.throughput --out "/tmp/$name" "$@" > "/tmp/$name.log" 2>&1
  echo "== $name (rc $?, $(( $(date +%s) - T0 )) s)"
  grep -E "^\||^\[round|on NVIDIA|train split" "/tmp/$name.log" | cut -c1-400
  cp "/tmp/$name/summary.json" "$OUT/$name.json" 2>/dev/null || tail -5 "/tmp/$name.log"
}

probe() {  # probe NAME RECIPE ARGS...: 3 compiled, fully checkpointed steps at seq 4096, memory by phase and block
  local name=$1 recipe=$2; shift 2
  timeout -k 5 170 python3 -m titan_lightning.cli fit --recipe "$recipe" --trainer.callbacks+ \
    benchmarks.memory_probe.MemoryProbe --trainer.accelerator gpu --trainer.devices 1 --trainer.max_steps 3 \
    --trainer.limit_val_batches 0 --trainer.enable_checkpointing false --job.compile.enable true \
    --job.activation_checkpoint.mode full --job.data.repeat_to_fit true --job.training.seq_len 4096 \
    --job.training.tokens_per_microbatch_per_dp_rank 4096 "$@" > "$OUT/$name.log" 2>&1
  echo "== $name, memory (rc $?, $(( $(date +%s) - T0 )) s)"
  grep -oE "\[memory .*" "$OUT/$name.log" | cut -c1-120 | head -24
}

case "${1:-}" in
1)
  BENCH_SYNC_AUDIT=$OUT bench sft_syncs 270 --rounds 1 --steps 6 --warmup 4 --contenders titan \
    --reference 'titan (qwen2_5_1_5b_pretrain)' \
    --workload qwen2_5_1_5b_sft_tuned,qwen2_5_1_5b_sft_tuned_quiet,qwen2_5_1_5b_pretrain
  bench sft_8b "$(left 580)" --rounds 1 --steps 5 --warmup 4 --reference 'titan (llama3_8b_16l_sft_tuned)' \
    --contenders titan --workload llama3_8b_16l_sft_default,llama3_8b_16l_sft_tuned
  ;;
2)
  # (run 5 measured llama3_8b_lora with per-step logging and a synchronizing clock: 1.470x PEFT; run 6's
  # titan rows hit a 150 s limit: ~95 s of a row was before its first step, ~50 s of it a random init
  # the folder's weights then replaced, skipped since 9971834)
  BENCH_CLOCK=events bench lora_8b 570 --rounds 1 --steps 5 --warmup 4 --profile-steps 2 --timeout 360 \
    --reference 'titan (llama3_8b_lora_quiet)' --workload llama3_8b_lora_quiet
  ;;
2b)
  for row in llama3_8b_lora_float8_quiet llama3_8b_qlora_quiet; do
    BENCH_CLOCK=events bench "$row" 285 --rounds 1 --steps 5 --warmup 4 --timeout 280 --workload "$row" \
      --contenders titan
  done
  ;;
11)
  # #48 on one H200 in one run: LoRA 8B (no AC, selective AC) against PEFT (without and with gradient
  # checkpointing), QLoRA 8B without AC (after 1f890bf: no dequantized weight kept; run 8 read 37.3 GiB,
  # estimate now 25.0) and fully checkpointed (estimate 8.9 GiB)
  BENCH_CLOCK=events bench lora_8b_h200 "$(left 580)" --rounds 1 --steps 5 --warmup 4 --timeout 200 \
    --reference 'titan (llama3_8b_lora_quiet)' \
    --workload llama3_8b_lora_quiet,llama3_8b_lora_selective_quiet,llama3_8b_lora_hf_ac,llama3_8b_qlora_quiet,llama3_8b_qlora_full_quiet
  ;;
6)
  bench lora_8b_hf_ac 400 --rounds 1 --steps 5 --warmup 3 --timeout 300 --workload llama3_8b_lora_hf_ac
  ;;
4)
  # The blocks' memory first (run 7: +2.2 GiB a block with their checkpoint compiled, out of memory
  # on the H100 at 77 GiB; since a47392e the checkpoint stays eager: ~64 MiB a block expected)
  probe qlora_70b_16l recipes.llama3:llama3_70b --job.lora.rank 16 --job.lora.alpha 32 --job.lora.quantize_base nf4 \
    --job.model.n_layers 16
  bench qlora_70b 570 --rounds 1 --steps 3 --warmup 2 --timeout 560 --workload llama3_70b_qlora --contenders titan
  ;;
3)
  # #44: SFT against pretraining, neither logging in the measured steps nor waiting for the device
  BENCH_CLOCK=events bench sft_quiet "${QUIET_S:-200}" --rounds 1 --steps 6 --warmup 4 --contenders titan \
    --reference 'titan (qwen2_5_1_5b_pretrain)' --workload qwen2_5_1_5b_sft_tuned_quiet,qwen2_5_1_5b_pretrain
  ;;
7)
  # (run 5 measured the frozen row alone; the issue wants every mode next to SFT, in one run)
  bench dpo "$(left 560)" --rounds 1 --steps 5 --warmup 3 --timeout 120 --contenders titan \
    --reference 'titan (qwen2_5_1_5b_sft_default)' \
    --workload qwen2_5_1_5b_sft_default,qwen2_5_1_5b_dpo,qwen2_5_1_5b_dpo_frozen,qwen2_5_1_5b_dpo_lora
  ;;
8)
  bench dpo_8b "$(left 580)" --rounds 1 --steps 4 --warmup 3 --timeout 150 --contenders titan \
    --reference 'titan (llama3_8b_16l_sft_default)' \
    --workload llama3_8b_16l_sft_default,llama3_8b_16l_dpo,llama3_8b_16l_dpo_frozen,llama3_8b_16l_dpo_lora
  ;;
5)
  for f in ${GPU_TESTS:-test_lora_gpu:280 test_preference_gpu:150}; do  # (run 5: 80 and 118 s; run 9: > 200 s)
    s=${f#*:}; f=${f%:*}
    timeout -k 5 "$(( $(left 580) < s ? $(left 580) : s ))" python3 -m pytest -o addopts= -q -p no:cacheprovider -m gpu -s \
      "tests/unit_tests/gpu/$f.py" > "/tmp/$f.log" 2>&1
    echo "== $f (rc $?, $(( $(date +%s) - T0 )) s)"; grep -E "passed|failed|error|tokens/s|Error" "/tmp/$f.log" | tail -8
  done
  ;;
9)
  GPU_TESTS="test_device_defaults_gpu:560" bash "$0" 5  # (#44's, > 280 s in run 5)
  ;;
10)
  # Is run 7's compiled-checkpoint memory (+2.2 GiB a 70B QLoRA block) general? The 8B shape, 8 layers,
  # full checkpointing, compiled: full fine-tuning, then LoRA on a bf16 base. The estimates (titan-lightning
  # estimate, same flags): parameters 10.41 GiB, peak 41.78 at the optimizer step (full); parameters 5.25,
  # peak 7.66 (LoRA). Each block's forward should keep its 32 MiB input alone.
  probe full_ac_8b_8l recipes.llama3:llama3_8b --job.model.n_layers 8
  probe full_ac_8b_8l_lora recipes.llama3:llama3_8b --job.model.n_layers 8 --job.lora.rank 16 --job.lora.alpha 32
  ;;
12)
  # Diagnostics of run 9 (#48): (a) does 1f890bf's checkpointed NF4 linear keep the dequantized weights
  # out of a compiled block under this device's torch (the CPU test)? (b) QLoRA 8B without AC (37.3 GiB
  # again, estimate 25.0): what is alive at its peak; (c) LoRA 8B selective AC vs none (selective was
  # 5% faster and 3.9 GiB larger): profiled, with the step's synchronizations
  timeout -k 5 150 python3 -m pytest -o addopts= -q -p no:cacheprovider tests/unit_tests/cpu/test_lora.py \
    -k compiled_qlora > "$OUT/qlora_test.log" 2>&1
  echo "== the compiled QLoRA block test (rc $?)"; tail -4 "$OUT/qlora_test.log"
  BENCH_MEMORY_SNAPSHOT=/tmp/mem BENCH_CLOCK=events bench qlora_mem 240 --rounds 1 --steps 2 --warmup 5 \
    --contenders titan --workload llama3_8b_qlora_quiet
  timeout -k 5 90 python3 -m benchmarks.memory_peak /tmp/mem/*.pickle > "$OUT/qlora_peak.txt" 2>&1
  head -45 "$OUT/qlora_peak.txt"
  BENCH_CLOCK=events BENCH_SYNC_AUDIT=$OUT bench lora_prof "$(left 560)" --rounds 1 --steps 3 --warmup 5 \
    --profile-steps 2 --contenders titan --workload llama3_8b_lora_selective_quiet,llama3_8b_lora_quiet
  cp /tmp/lora_prof.log "$OUT/" 2>/dev/null
  ;;
13)
  # #48 after run 9's two fixes, one H200, one run: LoRA 8B (the gradient norm's small gradients packed)
  # against PEFT, the same with the norm one call per gradient (A/B), fully checkpointed LoRA (estimate
  # 18.5 GiB) next to PEFT with gradient checkpointing, QLoRA 8B without AC (estimate 24.6 GiB; run 9:
  # 37.3, torch 2.11 kept the dequantized weights under a plain checkpoint)
  # (the rows the bar needs first; > 585 s in all: run as a chain, `wait 13` called again until it ends)
  BENCH_CLOCK=events bench lora_8b_run10 "$(left 900)" --rounds 1 --steps 8 --warmup 6 --timeout 180 \
    --reference 'titan (llama3_8b_lora_quiet)' \
    --workload llama3_8b_lora_quiet,llama3_8b_lora_separate_a_quiet,llama3_8b_lora_norm_per_tensor_quiet,llama3_8b_lora_combo_quiet,llama3_8b_qlora_quiet,llama3_8b_lora_full_quiet,llama3_8b_lora_hf_ac
  ;;
chain)
  shift
  mkdir -p /tmp/h200chain
  setsid nohup bash -c 'for p in "$@"; do OUT=/tmp/h200chain/$p bash benchmarks/h200_owed.sh "$p" \
    > "/tmp/h200chain/$p.out" 2>&1; touch "/tmp/h200chain/$p.done"; done' _ "$@" > /dev/null 2>&1 < /dev/null &
  echo "== chain of parts $* started"
  exit 0
  ;;
wait)
  part=$2 limit=${3:-580}
  while [ ! -e "/tmp/h200chain/$part.done" ] && [ "$(left "$limit")" -gt 0 ]; do sleep 5; done
  [ -e "/tmp/h200chain/$part.done" ] || { echo "== part $part still running after $limit s; its newest log:"
    grep -E "^\||^\[round|tokens/s|Error" "$(ls -t /tmp/*.log | head -1)" | tail -20 | cut -c1-300; }
  cat "/tmp/h200chain/$part.out" 2>/dev/null
  cp /tmp/h200chain/"$part"/* "$OUT"/ 2>/dev/null
  exit 0
  ;;
*) echo "usage: bash benchmarks/h200_owed.sh 1|2|2b|3|4|5|6|7|8|9, or chain PART..., or wait PART [SECONDS]" >&2; exit 2 ;;
esac
echo "== done in $(( $(date +%s) - T0 )) s"
