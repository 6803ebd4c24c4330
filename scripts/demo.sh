#!/usr/bin/env bash
# The main job on the embedded model: capture a real KV cache, then look at it.
# Everything lands in out/demo/ (overwritten on each run).
set -euo pipefail
OUT=${OUT_DIR:-out/demo}
mkdir -p "$OUT"
echo "== capture: SmolLM2-135M-Instruct (embedded GGUF) on the built-in prompt"
kvtool capture -o "$OUT/capture.safetensors" --force
echo
echo "== info"
kvtool info "$OUT/capture.safetensors" | tail -n 3
