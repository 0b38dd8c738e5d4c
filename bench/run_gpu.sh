#!/usr/bin/env bash
# One command for a GPU session (no network needed): tests on the GPU, the benchmark, the self-check.
#
#   bash bench/run_gpu.sh [BUDGET_SECONDS]        # default 540: fits a 10-minute call
#
# Writes under $OUT (default bench/results): <date>-<gpu>.json (DESIGN 4.2, with the test counts
# folded in), its PNG plots, gpu-tests.json, and the logs pytest.log, bench.log, selfcheck.log.
# Every step is time-limited; the benchmark saves partial results every ~20 s, so whatever was
# measured before a limit is kept. Environment knobs:
#   OUT, PYTHON (default python), PYTEST_ARGS (default "tests -q -p no:cacheprovider"),
#   TEST_SHARE (percent of the budget for pytest, default 35), BENCH_ARGS (extra benchmark options),
#   CUDA_BUILD_TIMEOUT (seconds to pre-build the CUDA extension, default 150; 0 skips it),
#   RUN_TESTS=0 / RUN_SELFCHECK=0 to skip those steps (e.g. a second call spent on the benchmark,
#   with BENCH_ARGS="--headdims 128" and the like).
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

# 1. the CUDA extension, built once so that tests and benchmark do not each pay for it
EXTRA_IMPLS=""
if [ "${CUDA_BUILD_TIMEOUT:-150}" -gt 0 ]; then
  log "pre-building the CUDA extension (limit ${CUDA_BUILD_TIMEOUT:-150}s)"
  timeout "${CUDA_BUILD_TIMEOUT:-150}" $PY - > "$OUT/cuda-build.log" 2>&1 <<'PY'
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
  rc=$?
  tail -n 3 "$OUT/cuda-build.log"
  if [ $rc -ne 0 ]; then
    log "CUDA backend not usable (rc $rc): benchmarking without ssa_flash.cuda"
    EXTRA_IMPLS="--impls ssa_flash.triton,sdpa.flash,sdpa.cudnn,sdpa.efficient,sdpa.math,flex,reference"
  fi
fi

# 2. the test suite on the GPU, counts written as it goes
if [ "${RUN_TESTS:-1}" != "0" ]; then
  TEST_LIMIT=$(( $(left) * ${TEST_SHARE:-35} / 100 ))
  PYTEST_ARGS=${PYTEST_ARGS:-"tests -q -p no:cacheprovider"}
  log "pytest $PYTEST_ARGS (limit ${TEST_LIMIT}s)"
  SSA_FLASH_TESTS_JSON="$OUT/gpu-tests.json" timeout --signal=TERM --kill-after=10 "$TEST_LIMIT" \
    $PY -m pytest -p ssa_flash.bench.pytest_summary $PYTEST_ARGS > "$OUT/pytest.log" 2>&1
  log "pytest rc $?: $(tail -n 1 "$OUT/pytest.log")"
  [ -f "$OUT/gpu-tests.json" ] || echo '{"passed": null, "failed": null, "skipped": null}' > "$OUT/gpu-tests.json"
  $PY -c 'import json, sys; d = json.load(open(sys.argv[1])); d["command"] = "pytest " + sys.argv[2]; json.dump(d, open(sys.argv[1], "w")); print("gpu tests:", d)' \
    "$OUT/gpu-tests.json" "$PYTEST_ARGS"
else
  log "tests skipped (RUN_TESTS=0)"
  echo '{"passed": null, "failed": null, "skipped": null, "command": "not run (RUN_TESTS=0)"}' > "$OUT/gpu-tests.json"
fi

# 3. the benchmark, with what is left (minus a margin for the self-check, plots and copying back)
SELF_CHECK_RESERVE=${SELF_CHECK_RESERVE:-90}
[ "${RUN_SELFCHECK:-1}" = "0" ] && SELF_CHECK_RESERVE=0
BENCH_BUDGET=$(( $(left) - SELF_CHECK_RESERVE - 30 ))
[ $BENCH_BUDGET -lt 30 ] && BENCH_BUDGET=30
log "benchmark (time budget ${BENCH_BUDGET}s for starting rows)"
timeout --signal=INT --kill-after=20 $(( BENCH_BUDGET + 60 )) \
  $PY -m ssa_flash.bench --out "$OUT" --gpu-tests-json "$OUT/gpu-tests.json" \
  --time-budget "$BENCH_BUDGET" --warmup-ms 10 --rep-ms 40 $EXTRA_IMPLS ${BENCH_ARGS:-} \
  > "$OUT/bench.log" 2>&1
log "benchmark rc $?"
grep -v '^\[ *[0-9]*/' "$OUT/bench.log" | tail -n 60

# 4. the self-check, with whatever time remains
SC_LIMIT=$(( $(left) - 10 ))
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
