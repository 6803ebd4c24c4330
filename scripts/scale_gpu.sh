#!/usr/bin/env bash
# docs/scale.md's measurements: every step a kvtool command as a user types it, timed from the outside
# (wall seconds and the command's peak host RSS), on a GPU machine, from the repository root.
# Results in $OUT: results.md (the table docs/scale.md takes), results.json (every step with the
# command's own --json output), log.txt and the gpu guards' ratios (gpu-ratios.json).
#
#   setup    a Llama-3-8B-shaped folder of seeded random weights (scripts/scale_model_folder.py; not timed as a user step)
#   cap131k  kvtool capture --model FOLDER --device cuda, 131,072 tokens, queries of layers 28-31
#   cap32k   the same, 32,768 tokens, queries of every layer (the input of the steps below)
#   compress bitmap 70%, once the CUDA extensions are built (they build in the background from the start)
#   verify   --no-model, the kernel against its torch reference
#   eval     6 formats, --no-model
#   info     the 32k capture, every tensor checked
#   guards   pytest -m gpu tests/test_gpu_commands.py (32k x 8 layers: times against reading the input)
#   compress-unchecked, verify-unchecked: the same without checksums and finite tests (their share)
#   recommend --budget 15% with the model on the GPU, in whatever time is left
# Each step is cut to what is left of BUDGET seconds. A rehearsal on a CPU at tiny size:
#   SHAPE=tiny LONG=2048 T=1024 CHUNK=512 QL=2-3 DEV=cpu GUARDS=0 BUDGET=600 OUT=/tmp/rehearsal bash scripts/scale_gpu.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_INTERPRET=${TRITON_INTERPRET:-0} COLUMNS=200
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=${W:-/tmp/scale}; rm -rf "$W"; mkdir -p "$W/steps"
BUDGET=${BUDGET:-480}
SHAPE=${SHAPE:-llama3-8b} LONG=${LONG:-131072} T=${T:-32768} CHUNK=${CHUNK:-8192} QL=${QL:-28-31} DEV=${DEV:-cuda} GUARDS=${GUARDS:-1}
START=$(date +%s)
LOG=$OUT/log.txt
left() { echo $((BUDGET - ($(date +%s) - START))); }
# step NAME LIMIT CMD...: stdout -> $W/steps/NAME.json, stderr -> the log; one "STEP {json}" line in the log
# with the command as typed, wall seconds, exit code and the command's peak RSS
step() {
  local name=$1 limit=$2; shift 2
  local l; l=$(left); [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -le 5 ]; then echo "STEP {\"step\": \"$name\", \"skipped\": \"no time left\", \"command\": \"$*\"}" >>"$LOG"; return; fi
  echo "== $name (limit ${limit}s): $*" >>"$LOG"
  python3 - "$name" "$limit" "$@" >"$W/steps/$name.json" 2>>"$LOG" <<'PY'
import json, resource, subprocess, sys, time
name, limit, cmd = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
t = time.perf_counter()
try:
    rc = subprocess.run(cmd, timeout=limit).returncode
except subprocess.TimeoutExpired:
    rc = "timeout"
typed = " ".join(cmd).replace("python3 -m kvtool", "kvtool")
line = {"step": name, "command": typed, "rc": rc, "seconds": round(time.perf_counter() - t, 2),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}
print("STEP " + json.dumps(line), file=sys.stderr)
PY
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo "commit $(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
  nproc; free -g | head -2; df -h "$W" | tail -1; date -u
} >>"$LOG" 2>&1

# the CUDA extensions build beside the captures (nvcc on the CPU while the GPU captures)
if [ "$DEV" != "cpu" ]; then
  ( s=$(date +%s); python3 -c "from kvtool.kernels.bitmap_prune_encode import _SOURCE; from kvtool.kernels.common import cuda_extension; cuda_extension('bitmap_prune_encode', [_SOURCE])" >>"$LOG" 2>&1; echo "EXT prune_encode rc $? $(( $(date +%s) - s )) s" >>"$LOG" ) &
  EXT1=$!
  ( s=$(date +%s); python3 -c "from kvtool.kernels.bitmap_sparse_attention import _cuda_extension; _cuda_extension()" >>"$LOG" 2>&1; echo "EXT sparse_attention rc $? $(( $(date +%s) - s )) s" >>"$LOG" ) &
  EXT2=$!
fi

K="python3 -m kvtool"
M=$W/$SHAPE
step setup 120 python3 scripts/scale_model_folder.py --shape "$SHAPE" --device "$DEV" --prompt-bytes $((LONG + 4096)) -o "$M"
step cap131k 150 $K capture --model "$M" --prompt-file "$M/prompt.txt" --max-tokens "$LONG" --truncate --device "$DEV" --chunk-size "$CHUNK" --query-layers "$QL" -o "$W/cap131k.safetensors" --json
ls -l "$W" >>"$LOG"; rm -f "$W/cap131k.safetensors"
step cap32k 90 $K capture --model "$M" --prompt-file "$M/prompt.txt" --max-tokens "$T" --truncate --device "$DEV" --chunk-size "$CHUNK" -o "$W/cap32k.safetensors" --json
[ "$DEV" != "cpu" ] && { wait $EXT1; wait $EXT2; echo "extensions ready at $(( $(date +%s) - START )) s" >>"$LOG"; }
step compress 60 $K compress "$W/cap32k.safetensors" --format bitmap --sparsity 0.7 --device "$DEV" -o "$W/cap32k.bitmap.safetensors" --json
step verify 60 $K verify "$W/cap32k.bitmap.safetensors" --no-model --device "$DEV" --json
step eval 120 $K eval "$W/cap32k.safetensors" --formats bitmap:sparsity=0.7 signvq pagestat snapstream quant bitmapq --no-paper --no-model --device "$DEV" --out-dir "$W/eval" --json
step info 30 $K info "$W/cap32k.safetensors" --json
if [ "$GUARDS" = 1 ]; then
  KVTOOL_GPU_RATIOS=$OUT/gpu-ratios.json step guards 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu_commands.py
fi
# the checks' share at 32 layers: the same commands without them (the source hashed again too)
rm -rf "${KVTOOL_CACHE:-$HOME/.cache/kvtool}/sha256"
step compress-unchecked 60 $K --no-verify-checksums --allow-nonfinite compress "$W/cap32k.safetensors" --format bitmap --sparsity 0.7 --device "$DEV" -o "$W/cap32k.bitmap2.safetensors" --json
step verify-unchecked 60 $K --no-verify-checksums --allow-nonfinite verify "$W/cap32k.bitmap.safetensors" --no-model --device "$DEV" --json
step recommend 300 $K recommend "$W/cap32k.safetensors" --budget 15% --model "$M" --no-texts --device "$DEV" -o "$W/plan.json" --json
echo "done at $(( $(date +%s) - START )) s" >>"$LOG"

python3 - "$OUT" "$W/steps" <<'PY'
import json, sys
from pathlib import Path
out, outputs = Path(sys.argv[1]), Path(sys.argv[2])
steps = [json.loads(l[5:]) for l in (out / "log.txt").read_text().splitlines() if l.startswith("STEP ")]
def result(name):
    try:
        return json.loads((outputs / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}
for s in steps:
    try:
        s["output"] = result(s["step"]) or (outputs / f"{s['step']}.json").read_text()[-4000:]
    except OSError:
        s["output"] = None
notes = {}
for s in steps:
    r = result(s["step"])
    if s["step"].startswith("cap") and r:
        notes[s["step"]] = f"{r['tokens']} tokens, {r['bytes_written'] / 1e9:.1f} GB written, capture {r['seconds']} s"
    elif s["step"].startswith("compress") and r:
        notes[s["step"]] = f"{100 * r.get('ratio', r.get('storage_ratio', 0)):.1f}% of dense"
    elif s["step"].startswith("verify") and r:
        a = r["attention"]
        notes[s["step"]] = f"rel L2 {a['overall']['rel_l2']:.3f}, backend {a['backend']}" + (f", kernel vs torch {a['kernel_vs_torch']['rel_l2']:.1e}" if a.get("kernel_vs_torch") else "")
    elif s["step"] == "eval" and r:
        notes["eval"] = ", ".join(f"{p['format']} {p.get('seconds', 0):.1f} s" for p in r.get("points", []))
rows = ["| step | command | wall s | peak RSS GB | rc | result |", "|---|---|---:|---:|---|---|"]
for s in steps:
    rows.append(f"| {s['step']} | `{s['command']}` | {s.get('seconds', '-')} | {s.get('peak_rss_bytes', 0) / 1e9:.2f} | {s.get('rc', s.get('skipped'))} | {notes.get(s['step'], '')} |")
(out / "results.md").write_text("\n".join(rows) + "\n")
(out / "results.json").write_text(json.dumps(steps, indent=1))
print("\n".join(rows))
PY
rm -rf "$W"
