#!/usr/bin/env bash
# Device-side driver for the multi-GPU measurements in docs/scale.md (run from the repository root
# on a host with several GPUs; results land in $OUT: log.txt, steps.jsonl, smi.csv, pytest.txt).
# Steps, each cut to what is left of BUDGET s:
#   ext       the bitmap CUDA extensions built in the background (first use on a fresh machine)
#   capture   `kvtool capture --model random:$SHAPE --device-map auto`: $TOKENS random tokens, every
#             layer's keys/values/queries streamed to disk (wall time, peak host RSS of the command)
#   check     the same model's first layers built on one GPU: two 2-layer slices (layers 0-1 and the
#             two layers around the first GPU boundary) captured again and compared with the split run
#   compress  bitmap 70% with --device auto (layers spread over the GPUs)
#   verify    --no-model, --device auto
#   eval      a 2-point sweep (bitmap 70%, KIVI 4-bit), --no-model, --device auto
#   model     verify with the model (random weights of $SHAPE, spread over the GPUs when too large
#             for one) scoring the continuation through the compressed layers, --generate 8
#   recommend --budget 15% --no-model, --device auto
#   generate  32 greedy tokens from the bitmap file with the model spread over the GPUs (its live
#             cache beside each layer)
#   pytest    the gpu tests of the multi-GPU code (2+ GPUs)
# STEPS (default: all of them) picks some, e.g. STEPS="capture compress eval".
# nvidia-smi samples every GPU's memory and utilisation once a second into smi.csv throughout.
# A dry run on a CPU:
#   SHAPE=tiny TOKENS=2048 CHUNK=512 DEV=cpu bash scripts/multi_gpu.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_INTERPRET=${TRITON_INTERPRET:-0} COLUMNS=200
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=${W:-/tmp/mgpu}; mkdir -p "$W"
export KVTOOL_CACHE=${KVTOOL_CACHE:-/tmp/kvtool-cache}  # kept between calls on a warm machine (the extensions build once)
BUDGET=${BUDGET:-380}
SHAPE=${SHAPE:-llama3-70b} TOKENS=${TOKENS:-32768} CHUNK=${CHUNK:-8192} DEV=${DEV:-auto} MAP=${MAP:-auto}
START=$(date +%s)
LOG=$OUT/log.txt
RESULTS=$OUT/steps.jsonl
left() { echo $((BUDGET - ($(date +%s) - START))); }
STEPS=" ${STEPS:-capture check compress verify eval model generate recommend pytest} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
# timed NAME LIMIT CMD...: the command's stdout is one JSON object (--json), kept with its wall
# time, exit code and peak RSS as one line of steps.jsonl; stderr -> log
timed() {
  local name=$1 limit=$2; shift 2
  local l; l=$(left); [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -le 5 ]; then echo "{\"step\": \"$name\", \"skipped\": \"no time left\"}" >>"$RESULTS"; return; fi
  echo "== $name (limit ${limit}s) at $(($(date +%s) - START)) s: $*" >>"$LOG"
  python3 - "$name" "$limit" "$@" >>"$RESULTS" 2>>"$LOG" <<'PY'
import json, resource, subprocess, sys, time
name, limit, cmd = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
t = time.perf_counter()
try:
    p = subprocess.run(cmd, timeout=limit, stdout=subprocess.PIPE, text=True)
    rc, out = p.returncode, p.stdout
except subprocess.TimeoutExpired as exc:
    rc, out = "timeout", exc.stdout or ""
    out = out.decode() if isinstance(out, bytes) else out
try:
    result = json.loads(out)
except ValueError:
    result = out[-2000:]
line = {"step": name, "rc": rc, "seconds": round(time.perf_counter() - t, 2),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, "result": result}
print(json.dumps(line))
PY
}
{
  date -u; echo "commit ${COMMIT:-unknown}"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'gpus', torch.cuda.device_count())"
  python3 -c "import triton; print('triton', triton.__version__)" 2>&1
  nproc; free -g | head -2; df -h "$W" | tail -1
} >>"$LOG" 2>&1
SMI=
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv,noheader -l 1 >"$OUT/smi.csv" 2>/dev/null &
  SMI=$!
  ( t=$(date +%s); python3 -c "
from pathlib import Path
from kvtool.kernels.common import cuda_extension
from kvtool.kernels import bitmap_prune_encode as pe, bitmap_sparse_attention as sa
cuda_extension('bitmap_prune_encode', [pe._SOURCE]); sa._cuda_extension()" >>"$LOG" 2>&1
    echo "{\"step\": \"ext\", \"rc\": $?, \"seconds\": $(($(date +%s) - t))}" >>"$RESULTS" ) &
  EXT=$!
fi
K="python3 -m kvtool"
CAP=$W/cap.safetensors
DEVMAP="--device-map $MAP"
want capture && timed capture 200 $K capture --model "random:$SHAPE" $DEVMAP --random-tokens "$TOKENS" --chunk-size "$CHUNK" -o "$CAP" --json
ls -l "$W" >>"$LOG"
REFDEV=cuda:0; case $DEV in cpu*) REFDEV=cpu;; esac
want check && timed check 90 python3 scripts/multi_gpu_check.py "$CAP" --device "$REFDEV"
[ -n "${EXT:-}" ] && { echo "waiting for the extension build at $(($(date +%s) - START)) s" >>"$LOG"; wait $EXT; }
want compress && timed compress 120 $K compress "$CAP" --format bitmap --sparsity 0.7 --device "$DEV" -o "$W/cap.bitmap.safetensors" --json
want verify && timed verify 120 $K verify "$W/cap.bitmap.safetensors" --no-model --device "$DEV" --json
want eval && timed eval 200 $K eval "$CAP" --formats bitmap:sparsity=0.7 quant:bits=4 --no-paper --no-model --device "$DEV" --out-dir "$W/eval" --json
want model && timed model 240 $K verify "$W/cap.bitmap.safetensors" --model "random:$SHAPE" --generate 8 --device "$DEV" --json
want generate && timed generate 200 $K generate "$W/cap.bitmap.safetensors" --model "random:$SHAPE" --max-new-tokens 32 --device "$DEV" --json
want recommend && timed recommend 300 $K recommend "$CAP" --budget 15% --no-model --device "$DEV" -o "$W/plan.json" --json
rm -f "$CAP" "$W/cap.bitmap.safetensors"
if want pytest && [ "$(left)" -gt 10 ]; then
  timeout "$(left)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_placement.py tests/test_placement_recommend.py tests/test_shapes.py >"$OUT/pytest.txt" 2>&1
  echo "pytest rc $? at $(($(date +%s) - START)) s" >>"$OUT/pytest.txt"
fi
[ -n "$SMI" ] && kill "$SMI"
echo "done at $(($(date +%s) - START)) s" >>"$LOG"
rm -rf "$W"
