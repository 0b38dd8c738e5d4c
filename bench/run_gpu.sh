#!/usr/bin/env bash
# One command for a GPU session (no network needed): the smoke tier, the test suite on the GPU,
# the benchmark, the self-check.
#
#   bash bench/run_gpu.sh [BUDGET_SECONDS]        # default 540: fits a 10-minute call
#
# Steps, in order, each time-limited:
#   1. pre-build the CUDA extension (so that tests and benchmark do not each pay for it);
#   2. the GPU smoke tier, `pytest -m gpu_smoke tests` (tests/gpu_smoke/test_gpu_smoke.py): every kernel
#      family once (four variants forward and backward; masks, causal, GQA, dropout, windows,
#      varlen, KV cache with split-KV, the entropy pass; fp16 and bf16; Triton and CUDA C++
#      backends) at small odd shapes against the float64 reference with FlashAttention's rule.
#      A few minutes, nearly all kernel compilation: it runs first so that a short GPU session
#      learns in its first call whether every kernel compiles and computes the right thing;
#   3. the rest of the test suite (the smoke tier deselected: it has just run);
#   4. the benchmark (saves partial results every ~20 s, so whatever was measured before a limit
#      is kept); 5. the self-check (python -m ssa_flash).
# Writes under $OUT (default bench/results): <date>-<gpu>.json (the results file of docs/design.md
# §4.2, with the suite's test counts folded in), its PNG plots, smoke-tests.json and
# gpu-tests.json (test counts, written as the tests run), and the logs cuda-build.log, smoke.log,
# pytest.log, bench.log, selfcheck.log. Environment knobs:
#   OUT, PYTHON (default python), PYTEST_ARGS (default "tests -q -p no:cacheprovider"),
#   SMOKE_LIMIT (seconds for the smoke tier, default 300, capped to leave 120 s for the rest),
#   TEST_SHARE (percent of the remaining budget for pytest, default 35), BENCH_ARGS (extra
#   benchmark options), CUDA_BUILD_TIMEOUT (seconds to pre-build the CUDA extension, default 150;
#   0 skips it), RUN_SMOKE=0 / RUN_TESTS=0 / RUN_SELFCHECK=0 to skip those steps (e.g. a second
#   call spent on the benchmark, with BENCH_ARGS="--headdims 128" and the like; with RUN_SMOKE=0
#   the suite runs the smoke tests too).
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

# 2. the smoke tier: every kernel family once, small shapes, both backends (tests/gpu_smoke/test_gpu_smoke.py)
SMOKE_DESELECT=()
if [ "${RUN_SMOKE:-1}" != "0" ]; then
  SMOKE_LIMIT=${SMOKE_LIMIT:-300}
  [ "$SMOKE_LIMIT" -gt $(( $(left) - 120 )) ] && SMOKE_LIMIT=$(( $(left) - 120 ))
  [ "$SMOKE_LIMIT" -lt 60 ] && SMOKE_LIMIT=60
  log "smoke tier: pytest -m gpu_smoke tests (limit ${SMOKE_LIMIT}s)"
  rm -f "$OUT/smoke-tests.json"  # no stale counts if pytest dies before writing any
  SSA_FLASH_TESTS_JSON="$OUT/smoke-tests.json" timeout --signal=TERM --kill-after=10 "$SMOKE_LIMIT" \
    $PY -m pytest -p ssa_flash.bench.pytest_summary -m gpu_smoke tests -q -rfEs -p no:cacheprovider \
    --durations=10 > "$OUT/smoke.log" 2>&1
  rc=$?
  [ -f "$OUT/smoke-tests.json" ] || echo '{"passed": null, "failed": null, "skipped": null}' > "$OUT/smoke-tests.json"
  log "smoke tier rc $rc$([ $rc -eq 124 ] && echo ' (time limit)'): $(tail -n 1 "$OUT/smoke.log")"
  grep -E '^(FAILED|ERROR|SKIPPED)' "$OUT/smoke.log" | head -n 40
  $PY -c 'import json, sys; d = json.load(open(sys.argv[1])); d["command"] = "pytest -m gpu_smoke tests"; json.dump(d, open(sys.argv[1], "w")); print("smoke tests:", d)' \
    "$OUT/smoke-tests.json"
  SMOKE_DESELECT=(-m "not gpu_smoke")  # already run; a -m in PYTEST_ARGS comes later and wins
else
  log "smoke tier skipped (RUN_SMOKE=0)"
fi

# 3. the test suite on the GPU, counts written as it goes
if [ "${RUN_TESTS:-1}" != "0" ]; then
  TEST_LIMIT=$(( $(left) * ${TEST_SHARE:-35} / 100 ))
  [ $TEST_LIMIT -lt 30 ] && TEST_LIMIT=30
  PYTEST_ARGS=${PYTEST_ARGS:-"tests -q -p no:cacheprovider"}
  if [ ${#SMOKE_DESELECT[@]} -gt 0 ]; then
    TEST_CMD="pytest -m 'not gpu_smoke' $PYTEST_ARGS (the gpu_smoke tier ran before it: smoke-tests.json)"
  else
    TEST_CMD="pytest $PYTEST_ARGS"
  fi
  log "$TEST_CMD (limit ${TEST_LIMIT}s)"
  SSA_FLASH_TESTS_JSON="$OUT/gpu-tests.json" timeout --signal=TERM --kill-after=10 "$TEST_LIMIT" \
    $PY -m pytest -p ssa_flash.bench.pytest_summary ${SMOKE_DESELECT[@]+"${SMOKE_DESELECT[@]}"} $PYTEST_ARGS \
    > "$OUT/pytest.log" 2>&1
  log "pytest rc $?: $(tail -n 1 "$OUT/pytest.log")"
  [ -f "$OUT/gpu-tests.json" ] || echo '{"passed": null, "failed": null, "skipped": null}' > "$OUT/gpu-tests.json"
  $PY -c 'import json, sys; d = json.load(open(sys.argv[1])); d["command"] = sys.argv[2]; json.dump(d, open(sys.argv[1], "w")); print("gpu tests:", d)' \
    "$OUT/gpu-tests.json" "$TEST_CMD"
else
  log "tests skipped (RUN_TESTS=0)"
  echo '{"passed": null, "failed": null, "skipped": null, "command": "not run (RUN_TESTS=0)"}' > "$OUT/gpu-tests.json"
fi

# 4. the benchmark, with what is left (minus a margin for the self-check, plots and copying back)
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

# 5. the self-check, with whatever time remains
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
