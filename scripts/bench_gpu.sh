#!/usr/bin/env bash
# Device-side driver for `kvtool bench` runs (used through the device tool; see docs/benchmarks.md).
# Usage (from the repository root on the GPU machine): bash scripts/bench_gpu.sh STEP...
# Installs carried wheels from ../.whl (if any) into /tmp/site, restores a carried FlashInfer JIT cache,
# runs each STEP (a shell function below), and saves logs / JSON / plots under $OUT.
set -u
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-230} PYTHONPATH=.:/tmp/site FLASHINFER_WORKSPACE_BASE=/tmp/fiws
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# a copied tree's .git may be older than its files: a COMMIT file written before the copy names the commit
[ -z "${KVTOOL_COMMIT:-}" ] && [ -f COMMIT ] && export KVTOOL_COMMIT=$(cat COMMIT)
WHL=${WHL:-../.whl}
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || echo "wheel install failed"
  # old mtimes on the installed headers, so that ninja trusts a carried FlashInfer JIT cache
  find /tmp/site -exec touch -h -d 2020-01-01 {} + 2>/dev/null
fi
if [ -f "$WHL/fi_jit.tgz" ]; then mkdir -p /tmp/fiws && tar -xzf "$WHL/fi_jit.tgz" -C /tmp/fiws; fi

info() {
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,clocks.max.sm,power.limit --format=csv
  python3 - <<'PY'
import torch, triton
p = torch.cuda.get_device_properties(0)
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, p.name, p.multi_processor_count, "SMs", getattr(p, "L2_cache_size", 0) // 2**20, "MiB L2")
try:
    import flashinfer; print("flashinfer", flashinfer.__version__)
except Exception as e:
    print("flashinfer import failed:", type(e).__name__, e)
PY
}
bench() {  # bench NAME SUB ARGS...
  local name=$1; shift
  python3 -m kvtool bench "$@" -o "$OUT/$name.json" --plot-output "$OUT/$name.png" --force 2>&1 | tee "$OUT/$name.txt" | tee -a "$OUT/run.log"
}
profile() {  # profile NAME KERNEL-REGEX ARGS... (ncu on the second launch of the kernel)
  local name=$1 regex=$2; shift 2
  ncu --kernel-name "regex:$regex" --launch-skip 1 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section Occupancy --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats python3 scripts/profile_kernel.py "$@" > "$OUT/$name.ncu.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Grid Size|Block Size|Stall|L1/TEX Hit|L2 Hit|Theoretical Occ|Shared Memory Config|Dynamic Shared|Executed Instructions |Issue Slots Busy|Issued Ipc|Avg. Active Threads|Avg. Not Predicated" "$OUT/$name.ncu.txt" | head -50
}
breakdown() {  # breakdown NAME KERNEL BATCH SEQ PARAM (torch.profiler table of 10 calls)
  local name=$1; shift
  python3 scripts/profile_kernel.py "$@" breakdown 2>&1 | tee "$OUT/$name.prof.txt" | cut -c1-200 | head -40
}
checks() {  # checks [-k EXPR]: `pytest -m gpu`, the kernels against their references on CUDA
  python3 -m pytest -q -m gpu tests "$@" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
}
save_jit() {
  if [ -d /tmp/fiws/.cache ]; then tar -czf "$OUT/fi_jit.tgz" -C /tmp/fiws .cache && ls -la "$OUT/fi_jit.tgz"; fi
}
warm_fi() {  # warm_fi DTYPES HEAD_DIMS: JIT-compile FlashInfer's batch decode (both paths) per dtype x head_dim, in parallel
  local dt hd
  for dt in ${1//,/ }; do for hd in ${2//,/ }; do
    python3 - "$dt" "$hd" > "/tmp/warm_fi_${dt}_${hd}.log" 2>&1 <<'PY' &
import sys, torch
from kvtool.bench import harness as B
dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[sys.argv[1]]
shape = B.model_shape("custom", 32, 8, int(sys.argv[2]))
q, k, v = B.random_decode_inputs(shape, 2, 256, dt, "cuda")
fid = B.FlashInferDecode(B.flashinfer_module(), k, v, 32, 1.0, 16)
for tc in (False, True):
    fid.batch(q, tc)
torch.cuda.synchronize()
print("warm", sys.argv[1:], "ok")
PY
  done; done
}
build_ext() {  # the bitmap attention extension built (or found in $KVTOOL_CACHE) before anything is timed
  python3 -c "import time; t=time.time(); from kvtool.kernels.bitmap_sparse_attention import _cuda_extension; _cuda_extension(); print('bitmap_sparse_attention extension ready in %.0f s' % (time.time() - t))"
}
save_ext() {  # the built CUDA extensions, for a later machine of the same image (load_ext)
  local root=${KVTOOL_CACHE:-$HOME/.cache/kvtool}
  if [ -d "$root/cuda-ext" ]; then tar -czf "$OUT/kv_ext.tgz" -C "$root" cuda-ext && ls -la "$OUT/kv_ext.tgz"; fi
}
load_ext() {  # load_ext TGZ: restore save_ext's archive; sources dated old so that ninja keeps the objects
  local root=${KVTOOL_CACHE:-$HOME/.cache/kvtool}
  mkdir -p "$root" && tar -xzf "$1" -C "$root" && find kvtool/kernels -name '*.cu*' -exec touch -d 2020-01-01 {} + && echo "restored $1"
}
for step in "$@"; do eval "$step"; done
# at most 8 files come back: pack everything but the logs into one archive
(cd "$OUT" && tar -czf /tmp/results.tgz --exclude run.log --exclude fi_jit.tgz . && mv /tmp/results.tgz . && find . -type f ! -name results.tgz ! -name run.log ! -name fi_jit.tgz -delete && ls -la)
