#!/usr/bin/env bash
# Device-side driver for the measurements in docs/scale.md (run from the repository root on a GPU
# machine; results land in $OUT). Steps, in order of priority, each cut to what is left of BUDGET s:
#   cap131k  streaming capture, Llama-3-8B-shaped random model, 131,072 tokens, queries of layer 1
#   cap32k   the same model, 32,768 tokens, queries of every layer (the verify/eval input)
#   pytest   pytest -m gpu (in the background while cap32k and compress run)
#   compress bitmap at 70% on the GPU, 64 held-out tokens
#   verify   64 held-out queries, kernel against the torch reference, on the GPU
#   eval     6 formats at attention level on the GPU
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_INTERPRET=${TRITON_INTERPRET:-0} COLUMNS=200
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=${W:-/tmp/scale}; mkdir -p "$W"
BUDGET=${BUDGET:-400}
# a dry run on a CPU: T1=4096 T2=1024 DEV=cpu EXTRA="--small --device cpu --layers 2" bash scripts/scale_gpu.sh
T1=${T1:-131072} T2=${T2:-32768} DEV=${DEV:-cuda} EXTRA=${EXTRA:-}
START=$(date +%s)
LOG=$OUT/log.txt
left() { echo $((BUDGET - ($(date +%s) - START))); }
# timed NAME LIMIT CMD...: stdout -> $OUT/NAME.json, stderr -> log; wall time, rc and the child's
# peak RSS as one "STEP" line in the log
timed() {
  local name=$1 limit=$2; shift 2
  local l; l=$(left); [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -le 5 ]; then echo "STEP {\"step\": \"$name\", \"skipped\": \"no time left\"}" >>"$LOG"; return; fi
  echo "== $name (limit ${limit}s)" >>"$LOG"
  python3 - "$name" "$limit" "$@" >"$OUT/$name.json" 2>>"$LOG" <<'PY'
import json, resource, subprocess, sys, time
name, limit, cmd = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
t = time.perf_counter()
try:
    rc = subprocess.run(cmd, timeout=limit).returncode
except subprocess.TimeoutExpired:
    rc = "timeout"
line = {"step": name, "rc": rc, "seconds": round(time.perf_counter() - t, 2), "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}
print("STEP " + json.dumps(line), file=sys.stderr)
PY
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git log -1 --format='commit %H %cI' 2>/dev/null || true
  df -h "$W" | tail -1; free -g | head -2; date -u
} >>"$LOG" 2>&1

K="python3 -m kvtool"
timed cap131k 150 python3 scripts/scale_llama8b.py $EXTRA --tokens "$T1" --chunk-size 8192 --query-layers 1 -o "$W/cap131k.safetensors"
ls -l "$W" >>"$LOG"; rm -f "$W/cap131k.safetensors"
( timeout "$(left)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_scale.py >"$OUT/pytest.txt" 2>&1; echo "pytest rc $? at $(($(date +%s) - START)) s" >>"$OUT/pytest.txt" ) &
PYTEST=$!
timed cap32k 90 python3 scripts/scale_llama8b.py $EXTRA --tokens "$T2" --chunk-size 8192 -o "$W/cap32k.safetensors"
timed compress 60 $K compress "$W/cap32k.safetensors" --format bitmap --sparsity 0.7 --heldout 64 --device "$DEV" -o "$W/cap32k.bitmap.safetensors" --json
wait $PYTEST
timed verify 90 $K verify "$W/cap32k.bitmap.safetensors" --heldout 64 --backend triton --device "$DEV" --no-model --json
timed eval 200 $K eval "$W/cap32k.safetensors" --formats bitmap:sparsity=0.7 signvq pagestat snapstream quant bitmapq --no-paper --no-model --heldout 64 --device "$DEV" -o "$W/eval" --json
echo "done at $(($(date +%s) - START)) s" >>"$LOG"
rm -rf "$W"
