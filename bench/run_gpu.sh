#!/usr/bin/env bash
# One command for a GPU session (no network needed): the smoke tier, the test suite on the GPU,
# the benchmark, the self-check.
#
#   bash bench/run_gpu.sh [BUDGET_SECONDS]        # default 540: fits a 10-minute call
#
# Steps, in order, each time-limited:
#   1. the CUDA extension's build starts in the background (minutes of nvcc; torch's build lock
#      makes any test that loads the extension meanwhile wait for it, then load the result);
#   2. while it builds, the Triton half: first the tests of RECHECK (default bench/gpu_recheck.txt,
#      one pytest node id per line: what failed on the last GPU run, so that the next one begins
#      with their tracebacks), then the GPU smoke tier without the CUDA backend
#      (`pytest -m gpu_smoke -k "not cuda"`: tests/gpu_smoke/test_gpu_smoke.py, every kernel family
#      once at small odd shapes against the float64 reference with FlashAttention's rule), then
#      the GPU suite's other tests that do not touch the CUDA backend (SUITE below);
#   3. once the build is done (or BUILD_WAIT seconds into the run): the CUDA half, the smoke tier's
#      CUDA tests and then the suite's;
#   4. the benchmark (saves partial results every ~20 s, so whatever was measured before a limit
#      is kept); 5. the self-check (python -m ssa_flash).
# pytest runs with pytest-xdist workers (-n JOBS, default 8) where xdist is installed: nearly all
# of a first GPU run is kernel compilation, which the workers share out.
# Writes under $OUT (default bench/results): <date>-<gpu>.json (the results file of docs/design.md
# §4.2, with the suite's test counts folded in), its PNG plots, the test counts <step>-tests.json
# (smoke-triton, suite-triton, smoke-cuda, suite-cuda; written as the tests run) and gpu-tests.json
# (their sum), and the logs cuda-build.log, <step>.log, bench.log, selfcheck.log.
# Environment knobs:
#   OUT, PYTHON (default python), RECHECK (file of node ids) / RECHECK_LIMIT (seconds, default 90) /
#   RUN_RECHECK=0, JOBS (xdist workers; 0: none), SUITE (test paths of the GPU suite: default every
#   test directory that runs kernels; the CPU-only compiles and audits, packaging, docs and the
#   distributed gloo tests are left to the CPU CI), BUILD_WAIT (default 300), SMOKE_LIMIT /
#   SUITE_LIMIT (seconds for each Triton step, default 120 / 150; the CUDA steps get half, or
#   CUDA_SMOKE_LIMIT / CUDA_SUITE_LIMIT: the CUDA C++ backend has not yet been checked on a GPU),
#   BENCH_ARGS (extra benchmark options), RUN_SMOKE=0 / RUN_TESTS=0 / RUN_CUDA=0 /
#   RUN_BENCH=0 / RUN_SELFCHECK=0 to skip those steps (e.g. a second call spent on the benchmark, with
#   BENCH_ARGS="--headdims 128" and the like).
set -u
BUDGET=${1:-${BUDGET:-540}}
START=$(date +%s)
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }
log() { echo "[run_gpu $(elapsed)s/${BUDGET}s] $*"; }
cap() { local want=$1 most=$(( $(left) - ${2:-0} )); [ "$want" -gt "$most" ] && want=$most; [ "$want" -lt 20 ] && want=20; echo "$want"; }

log "repo $(git rev-parse --short HEAD 2>/dev/null || echo '?'), out $OUT"
nvidia-smi -L 2>/dev/null || log "nvidia-smi unavailable"
$PY - <<'PY' || { log "python/torch/triton import failed"; exit 1; }
import sys, torch
try:
    import triton; tv = triton.__version__
except Exception as e:
    tv = f"missing ({e})"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {tv}, "
      f"cuda {torch.version.cuda}, device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE'}")
PY

XDIST=()
JOBS=${JOBS:-8}
if [ "$JOBS" != "0" ] && $PY -c 'import xdist' 2>/dev/null; then XDIST=(-n "$JOBS"); fi
SUITE=${SUITE:-"tests/test_features.py tests/triton tests/ops tests/nn tests/reference tests/integrations tests/cuda/test_cuda_backend.py tests/cuda/test_cuda_features.py tests/cuda/test_cuda_sinks_softcap.py"}

# 1. the CUDA extension, built once in the background
BUILD_PID=""
if [ "${RUN_CUDA:-1}" != "0" ]; then
  log "building the CUDA extension in the background (cuda-build.log)"
  ( t0=$(date +%s); $PY - > "$OUT/cuda-build.log" 2>&1 <<'PY'
import torch, ssa_flash
if "cuda" not in ssa_flash.available_backends("cuda"):
    from ssa_flash import cuda as c
    print("CUDA backend unavailable:", c.unavailable_reason(torch.device("cuda")))
    raise SystemExit(3)
q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
ssa_flash.ssa_attention(q, q, q, backend="cuda")
torch.cuda.synchronize()
print("CUDA backend built and ran")
PY
    rc=$?; echo "build + first call: $(( $(date +%s) - t0 )) s wall, rc $rc" >> "$OUT/cuda-build.log"; exit $rc
  ) &
  BUILD_PID=$!
fi

# one pytest step: name, limit, pytest arguments; counts in $OUT/<name>-tests.json
STEPS=()
step() {
  local name=$1 limit=$2; shift 2
  log "$name: pytest $* (limit ${limit}s)"
  rm -f "$OUT/$name-tests.json"
  SSA_FLASH_TESTS_JSON="$OUT/$name-tests.json" timeout --signal=TERM --kill-after=10 "$limit" \
    $PY -m pytest -p ssa_flash.bench.pytest_summary -q -rfEs -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"} "$@" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  [ -f "$OUT/$name-tests.json" ] || echo '{"passed": null, "failed": null, "skipped": null}' > "$OUT/$name-tests.json"
  log "$name rc $rc$([ $rc -eq 124 ] && echo ' (time limit)'): $(tail -n 1 "$OUT/$name.log")"
  grep -E '^(FAILED|ERROR)' "$OUT/$name.log" | head -n 30
  STEPS+=("$name")
}

# 2. the Triton half, while nvcc works; first what failed last time (node ids; '#' comments)
RECHECK=${RECHECK:-bench/gpu_recheck.txt}
if [ -f "$RECHECK" ] && [ "${RUN_RECHECK:-1}" != "0" ]; then
  mapfile -t RECHECK_IDS < <(grep -v '^\s*\(#\|$\)' "$RECHECK")
  if [ ${#RECHECK_IDS[@]} -gt 0 ]; then
    step recheck "$(cap "${RECHECK_LIMIT:-90}" 300)" --tb=long "${RECHECK_IDS[@]}"
  fi
fi
if [ "${RUN_SMOKE:-1}" != "0" ]; then step smoke-triton "$(cap "${SMOKE_LIMIT:-120}" 200)" -m gpu_smoke -k "not cuda" tests/gpu_smoke; fi
# shellcheck disable=SC2086
if [ "${RUN_TESTS:-1}" != "0" ]; then step suite-triton "$(cap "${SUITE_LIMIT:-150}" 200)" -m "not gpu_smoke" -k "not cuda" $SUITE; fi

# 3. the CUDA half
EXTRA_IMPLS=""
if [ -n "$BUILD_PID" ]; then
  while kill -0 "$BUILD_PID" 2>/dev/null && [ "$(elapsed)" -lt "${BUILD_WAIT:-300}" ]; do sleep 2; done
  if kill -0 "$BUILD_PID" 2>/dev/null; then
    log "CUDA build still running after ${BUILD_WAIT:-300}s: stopped; CUDA steps and benchmark rows skipped"
    kill -- "$BUILD_PID" 2>/dev/null; pkill -f "ssa_flash_cuda_ext" 2>/dev/null
    rc=124
  else
    wait "$BUILD_PID"; rc=$?
  fi
  tail -n 3 "$OUT/cuda-build.log"
  # what a fresh process (as each test worker is) says of the backend now
  $PY -c 'import torch; from ssa_flash import cuda; print("unavailable_reason in a new process:", cuda.unavailable_reason(torch.device("cuda")))' \
    >> "$OUT/cuda-build.log" 2>&1
  tail -n 1 "$OUT/cuda-build.log"
  if [ "$rc" -eq 0 ]; then
    if [ "${RUN_SMOKE:-1}" != "0" ]; then step smoke-cuda "$(cap "${CUDA_SMOKE_LIMIT:-$(( ${SMOKE_LIMIT:-120} / 2 ))}" 150)" -m gpu_smoke -k cuda tests/gpu_smoke; fi
    # shellcheck disable=SC2086
    if [ "${RUN_TESTS:-1}" != "0" ]; then step suite-cuda "$(cap "${CUDA_SUITE_LIMIT:-$(( ${SUITE_LIMIT:-150} / 2 ))}" 150)" -m "not gpu_smoke" -k cuda $SUITE; fi
  else
    log "CUDA backend not usable (rc $rc): benchmarking without ssa_flash.cuda"
    EXTRA_IMPLS="--impls ssa_flash.triton,sdpa.flash,sdpa.cudnn,sdpa.efficient,sdpa.math,flex,reference"
  fi
fi

# the steps' counts summed into gpu-tests.json, for the results file (the recheck step's tests are
# in the suite steps too: kept under "steps", not added to the totals)
$PY - "$OUT" ${STEPS[@]+"${STEPS[@]}"} <<'PY'
import json, os, sys
out, steps = sys.argv[1], sys.argv[2:]
total = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "incomplete": False, "steps": {}}
for name in steps:
    d = json.load(open(os.path.join(out, f"{name}-tests.json")))
    total["steps"][name] = d
    if name == "recheck":
        continue
    for k in ("passed", "failed", "skipped", "errors"):
        total[k] += d.get(k) or 0
    total["incomplete"] = total["incomplete"] or d.get("incomplete", True) or d.get("passed") is None
total["command"] = "bash bench/run_gpu.sh (pytest steps: " + ", ".join(steps) + ")"
if not steps:
    total.update(passed=None, failed=None, skipped=None, command="no tests run")
json.dump(total, open(os.path.join(out, "gpu-tests.json"), "w"))
print("gpu tests:", {k: v for k, v in total.items() if k != "steps"})
PY

# 4. the benchmark, with what is left (minus a margin for the self-check, plots and copying back)
SELF_CHECK_RESERVE=${SELF_CHECK_RESERVE:-60}
[ "${RUN_SELFCHECK:-1}" = "0" ] && SELF_CHECK_RESERVE=0
if [ "${RUN_BENCH:-1}" = "0" ]; then
  log "benchmark skipped (RUN_BENCH=0)"
else
  BENCH_BUDGET=$(( $(left) - SELF_CHECK_RESERVE - 40 ))
  [ $BENCH_BUDGET -lt 30 ] && BENCH_BUDGET=30
  log "benchmark (time budget ${BENCH_BUDGET}s for starting rows)"
  # shellcheck disable=SC2086
  timeout --signal=INT --kill-after=20 $(( BENCH_BUDGET + 30 )) \
    $PY -m ssa_flash.bench --out "$OUT" --gpu-tests-json "$OUT/gpu-tests.json" \
    --time-budget "$BENCH_BUDGET" --warmup-ms 10 --rep-ms 40 $EXTRA_IMPLS ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1
  log "benchmark rc $?"
  grep -v '^\[ *[0-9]*/' "$OUT/bench.log" | tail -n 40
fi

# 5. the self-check, with whatever time remains
SC_LIMIT=$(( $(left) - 5 ))
if [ "${RUN_SELFCHECK:-1}" = "0" ]; then
  log "self-check skipped (RUN_SELFCHECK=0)"
elif [ $SC_LIMIT -gt 20 ]; then
  log "python -m ssa_flash (limit ${SC_LIMIT}s)"
  timeout --kill-after=5 "$SC_LIMIT" $PY -m ssa_flash > "$OUT/selfcheck.log" 2>&1
  log "self-check rc $?: $(tail -n 1 "$OUT/selfcheck.log")"
else
  log "no time left for the self-check"
fi
ls -la "$OUT"
log "done"
