#!/usr/bin/env bash
# The KIVI decode kernel on a GPU: its gpu tests, `kvtool bench kivi`, and `kvtool bench decode` of
# KIVI 4-bit and the 15% plan (SnapKV + KIVI 4-bit per head) against dense at the Llama-3-8B shape,
# batch 8 x 32k. Results (logs, JSON, plots) under $OUT, packed by scripts/bench_gpu.sh.
# Usage, from the repository root on the GPU machine:  bash scripts/gpu_kivi.sh [tests] [kernel] [decode]
#   (no argument: all three; on an H100 about 3 + 2 + 4 minutes, so run `tests kernel` and `decode`
#   as two calls where one call may last at most 10 minutes)
# Rehearsal on the CPU at a tiny size (what CI can check):  KIVI_TINY=1 OUT=/tmp/kivi bash scripts/gpu_kivi.sh
set -u
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests kernel decode)
run=()
if [ "${KIVI_TINY:-0}" = 1 ]; then
  export TRITON_INTERPRET=1
  for s in "${steps[@]}"; do case $s in
    tests) run+=("python3 -m pytest -q tests/test_kivi_attention.py 2>&1 | tail -3 | tee \"\$OUT/cpu_tests.txt\"") ;;
    kernel) run+=("bench kivi kivi --model-shape custom --heads 8 --kv-heads 2 --head-dim 64 --batch 1 --seq 300 --rep-ms 1") ;;
    decode) run+=("bench decode_kivi decode --model-shape tiny --batch 1 --seq 256 --formats quant:bits=4 --formats snapkv:budget=128+quant:bits=4,group=128,residual=0 --runs 3") ;;
  esac; done
else
  run+=(info)
  for s in "${steps[@]}"; do case $s in
    tests) run+=("checks -k 'kivi or quant or captured'") ;;
    kernel) run+=("bench kivi kivi --batch 1,8 --seq 4k,32k --cuda-graph") ;;
    decode) run+=("bench decode_kivi decode --model-shape llama3-8b --batch 8 --seq 32k --formats quant:bits=4 --plan docs/benchmarks/decode-plan-15.json --runs 12") ;;
  esac; done
fi
exec bash scripts/bench_gpu.sh "${run[@]}"
