#!/usr/bin/env bash
# compute-sanitizer over every kvtool kernel at small odd shapes: memcheck, racecheck, initcheck and
# synccheck, each a run of scripts/sanitize_kernels.py (the CUDA extensions in every walk and staging,
# prune + encode, and the Triton kernels, each once, checked against its reference).
#
# Usage, from the repository root on the GPU machine (compute-sanitizer is in its image):
#   bash scripts/gpu_sanitize.sh                     all four tools, one after another (a few minutes)
#   TOOLS="racecheck synccheck" bash scripts/gpu_sanitize.sh    some of them
#   CASES=cuda bash scripts/gpu_sanitize.sh          only the cases whose name holds the text (sanitize_kernels.py -k)
#   PARALLEL=1 bash scripts/gpu_sanitize.sh          the tools at once, one process each (about the slowest tool's time)
# First an unsanitized run of the driver builds the CUDA extensions (kvtool env --build-kernels) and
# fills Triton's cache, so the sanitized runs compile nothing; each tool then runs under `timeout`
# (SANITIZE_TIMEOUT, default 150 s) with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that every tensor is an
# allocation of its own and memcheck sees a read past a tensor's end (the caching allocator would hide it).
# Results under $OUT (default ./out/gpu-sanitize): sanitize-TOOL.txt per tool (ERROR SUMMARY, reports
# per device function, kvtool's apart from torch's, the first reports in full, the driver's output),
# sanitize.json (all tools; "clean": every run finished, every case passed, no report in a kvtool
# kernel), driver.txt (the unsanitized run). Exit 0 when clean.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-./out/gpu-sanitize}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVTOOL_CACHE=${KVTOOL_CACHE:-$PWD/.kvtool-cache} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
TOOLS=${TOOLS:-memcheck racecheck initcheck synccheck}
LIMIT=${SANITIZE_TIMEOUT:-150}
CASES=${CASES:-}
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
if [ -z "$SAN" ]; then echo "gpu_sanitize: compute-sanitizer not found" >&2; exit 2; fi
rm -f "$OUT/sanitize.json"
t0=$(date +%s)
{
  "$PY" -m kvtool env --build-kernels --json | head -c 2000; echo
  "$PY" scripts/sanitize_kernels.py -k "$CASES"
} > "$OUT/driver.txt" 2>&1
echo "gpu_sanitize: unsanitized run: $(tail -1 "$OUT/driver.txt") ($(( $(date +%s) - t0 )) s)"
# run_tool TOOL: one sanitized run of the driver; its log and output kept for the summary
run_tool() {
  local tool=$1 extra=()
  case $tool in
    memcheck) extra=(--leak-check no) ;;
    racecheck) extra=(--racecheck-report analysis) ;;
  esac
  local log=$TMPD/$tool.log drv=$TMPD/$tool.out t1
  t1=$(date +%s)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 10 "$LIMIT" "$SAN" --tool "$tool" "${extra[@]}" --print-limit 1000 --log-file "$log" \
    "$PY" scripts/sanitize_kernels.py -k "$CASES" > "$drv" 2>&1
  echo "sanitizer exit $? after $(( $(date +%s) - t1 )) s" >> "$drv"
}
TMPD=$(mktemp -d /tmp/sanitize.XXXXXX)
if [ "${PARALLEL:-0}" = 1 ]; then  # every tool at once, each in its own process (the GPU is shared; each run's LIMIT still holds)
  for tool in $TOOLS; do run_tool "$tool" & done
  wait
else
  for tool in $TOOLS; do run_tool "$tool"; done
fi
status=0
for tool in $TOOLS; do
  "$PY" scripts/sanitize_kernels.py --summarize "$OUT" "$tool" "$TMPD/$tool.log" "$TMPD/$tool.out" || status=1
done
rm -rf "$TMPD"
echo "gpu_sanitize: $( [ $status = 0 ] && echo clean || echo NOT CLEAN ) in $(( $(date +%s) - t0 )) s; summaries in $OUT"
exit $status
