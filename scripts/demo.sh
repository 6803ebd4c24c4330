#!/usr/bin/env bash
# The main job on the embedded model, end to end: capture a real KV cache, look at it, compress it
# with every format, check what each costs, and continue generation from a compressed cache.
# Everything lands in out/demo/ (overwritten on each run). About 10 minutes on 2 CPU cores.
set -euo pipefail
OUT=${OUT_DIR:-out/demo}
CAP="$OUT/capture.safetensors"
mkdir -p "$OUT"
step() { printf '\n== %s\n' "$*"; }

step "capture: SmolLM2-135M-Instruct (embedded GGUF), built-in 1,084-token text, all 30 layers, float16"
kvtool capture --dtype float16 -o "$CAP" --force

step "info"
kvtool info "$CAP" | tail -n 1

step "stats: the 10 KV heads with the most outlier key channels"
kvtool stats "$CAP" --sort k_outliers --top 10

step "plots: layers 0, 7, 15, 23, 29 (open $OUT/plots/index.html)"
kvtool plot "$CAP" --all --layers 0,7,15,23,29 --out-dir "$OUT/plots" --force | tail -n 3

step "compress with each format (last 64 tokens held out for verify)"
kvtool compress "$CAP" --format bitmap --sparsity 0.7 -o "$OUT/cap.bitmap.safetensors" --force
kvtool compress "$CAP" --format signvq -o "$OUT/cap.signvq.safetensors" --force
kvtool compress "$CAP" --format pagestat --score unique --budget 256 -o "$OUT/cap.pagestat.safetensors" --force
kvtool compress "$CAP" --format snapstream --budget 256 -o "$OUT/cap.snapstream.safetensors" --force
kvtool compress "$CAP" --format quant:bits=4 -o "$OUT/cap.quant.safetensors" --force
kvtool compress "$CAP" --evict snapkv:budget=512 --prune per-token:k=0.5,v=0.5 --format quant:bits=4 -o "$OUT/cap.pipeline.safetensors" --force

step "verify: what each format costs (64 held-out queries; NLL, agreement, KL on the embedded model)"
kvtool verify "$OUT/cap.bitmap.safetensors" --generate 8
kvtool verify "$OUT/cap.quant.safetensors" --generate 8
kvtool verify "$OUT/cap.snapstream.safetensors" --generate 8
kvtool verify "$OUT/cap.pagestat.safetensors" --generate 8
kvtool verify "$OUT/cap.signvq.safetensors" --no-model
kvtool verify "$OUT/cap.pipeline.safetensors" --no-model

step "eval: every format, the papers' comparisons and the bytes-vs-fidelity frontier (sample capture)"
kvtool eval sample: --no-model --paper --out-dir "$OUT/eval" --force | tail -n 25

step "recommend: a plan per layer / KV head at 15% of the bytes, checked against the best uniform setting"
kvtool recommend "$CAP" --budget 15% --no-texts -o "$OUT/plan.json" --force
kvtool compress "$CAP" --plan "$OUT/plan.json" -o "$OUT/cap.plan.safetensors" --force
kvtool generate "$OUT/cap.plan.safetensors" --prompt " In short," -n 8   # the plan's live cache, per KV head

step "report: one HTML page (cache, frontier, plans at 10/15/25/40%) -> $OUT/report.html"
kvtool report "$CAP" --no-texts --budgets 10%,15%,25%,40% -o "$OUT/report.html" --force

step "heads: Polar Sparsity's head selection on the sample (it carries hidden states for the routers)"
kvtool heads sample: --plot-output "$OUT/heads.png" -o "$OUT/routers.safetensors" --force

step "export to a transformers cache and continue generation from compressed caches"
kvtool export "$CAP" --to hf -o "$OUT/cap.hf.safetensors" --force
kvtool generate "$OUT/cap.hf.safetensors" --prompt " In short," -n 16
kvtool generate "$OUT/cap.snapstream.safetensors" --prompt " In short," -n 16
