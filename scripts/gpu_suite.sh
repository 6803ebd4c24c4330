#!/usr/bin/env bash
# The whole gpu suite (`pytest -m gpu`: every test marked gpu, the `model` ones among them) on a GPU
# machine, split into chunks that each fit one run of about 8 minutes, every test under a timeout.
#
# Usage, from the repository root on the GPU machine:
#   bash scripts/gpu_suite.sh --list [--chunks N]      the chunk assignment and estimated times (no GPU needed)
#   bash scripts/gpu_suite.sh --chunk 1/3              run chunk 1 of 3 (one device call each: 1/3, 2/3, 3/3)
#   bash scripts/gpu_suite.sh --all [--chunks N] [--budget 570]   every chunk in one go, within a total time guard
#   bash scripts/gpu_suite.sh --merge DIR1 DIR2 DIR3   (anywhere) one summary of several calls' $OUT folders
# Options: --timeout S (per test, default 120), --budget S (this invocation, default 570: one device call
# is at most 600 s), --marker EXPR (default gpu), --durations SUMMARY.json (chunk by measured times; else
# scripts/gpu_suite_durations.json where it exists, else 3 s a test and 20 s a `model` test), --no-build,
# and test paths (default tests). GPU_SUITE_TIMEOUT / GPU_SUITE_BUDGET set the defaults too.
#
# What it does: builds the CUDA extensions once up front, in parallel (`kvtool env --build-kernels`) into
# $KVTOOL_CACHE (default ./.kvtool-cache, the one the tests use, so every chunk and a later call on the
# same warm machine find them built); collects the tests (same order on every machine, so `--chunk I/N`
# names the same tests in separate calls); runs the chunk's tests in pytest with pytest-timeout (thread
# method: a hung kernel blocks inside a CUDA call, where no signal handler runs; the method ends the
# process with the stacks of all threads) plus a watchdog of its own (dumps the stacks with SIGUSR1 and
# kills pytest when a test outlives the timeout by 30 s, or the budget runs out). A test whose pytest was
# ended under it is recorded as a timeout (or as crashed) and a fresh pytest goes on with the rest.
# Results under $OUT (default ./out/gpu-suite): chunk-I-of-N.xml (JUnit, one per chunk), summary.json
# (passed / failed / skipped / timeouts / errors / crashed / not run, each test's outcome and duration,
# device, torch / Triton / CUDA versions, commit), suite.log (all output). Exit 0 when every test passed
# or was skipped, 1 otherwise.
#
# pytest-timeout is in the GPU machine's image (2026-11); where it is missing the watchdog still ends a
# hung test, without pytest's report. To carry it: here, in the repository root,
#   echo /.whl/ >> .git/info/exclude   # already in .gitignore
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl pytest-timeout==2.4.0
# (pure Python: the platform tag only satisfies pip), then name `.whl` in the device call's carry; this
# script installs every .whl/*.whl (or $WHL/*.whl) into /tmp/site with pip --no-index --no-deps --target.
#
# CPU rehearsal (what CI tests, tests/test_gpu_suite.py): GPU_SUITE_DRY=1 collects the tests, assigns the
# chunks, resolves each chunk's node ids through the selection a run uses and writes the JUnit files and
# the summary with every test "not run"; nothing is built or run.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 KVTOOL_CACHE=${KVTOOL_CACHE:-$PWD/.kvtool-cache}
# a copied tree's .git may be older than its files: a COMMIT file written before the copy names the commit
[ -z "${KVTOOL_COMMIT:-}" ] && [ -f COMMIT ] && export KVTOOL_COMMIT=$(cat COMMIT)
for dir in .whl ${WHL:-}; do
  if ls "$dir"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$dir"/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || echo "gpu_suite: installing the wheels of $dir failed" >&2
  fi
done
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec "$PY" scripts/gpu_suite.py --python "$PY" "$@"
