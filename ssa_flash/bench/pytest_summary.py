"""pytest plugin writing the test counts to a JSON file as the run goes (so that a run killed by a
time limit still leaves its counts), for ``python -m ssa_flash.bench --gpu-tests-json``:

    SSA_FLASH_TESTS_JSON=out.json python -m pytest -p ssa_flash.bench.pytest_summary tests

Writes ``{"passed", "failed", "skipped", "errors", "incomplete", "exitstatus", "failures",
"skip_reasons"}``: ``failed`` counts failed tests and errors in setup/teardown (``errors`` counts
the latter alone); xfailed tests count as skipped, xpassed as passed; ``incomplete`` stays true
unless the session finished. ``failures``: the first ``MAX_FAILURES`` failures as they happen,
``{"test", "when", "error"}`` with the end of the error's report (``MAX_ERROR_CHARS``), so that a
run stopped by a time limit still says what failed and why (pytest prints its summary only at the
end, pytest-xdist's tracebacks too); ``skip_reasons``: reason -> count; ``tests``: node id ->
``{"outcome": "passed" | "failed" | "error" | "skipped", "duration_s"}`` of every test reported
so far (a failure in setup or teardown is "error" unless the test itself failed; the GPU ledger,
:mod:`ssa_flash.bench.ledger`, merges these). The file is rewritten at most every
``WRITE_EVERY_S`` seconds while tests run (and on SIGTERM, as ``timeout`` sends, and at the end).

Guards for GPU runs (tests/conftest.py loads this plugin in every session):

* A test that meets a CUDA error (:func:`is_cuda_error`: a device-side assert, an illegal
  address; the process's CUDA context is unusable afterwards) ends its process once its reports
  are sent, under pytest-xdist (which then starts a fresh worker and reports the test as
  crashed, besides its own failure) instead of every later test on that worker failing; without
  xdist the session stops after it. On a GPU, or with ``SSA_FLASH_CUDA_ERRORS_END_WORKERS=1``.
* ``SSA_FLASH_REQUIRE_CUDA=1`` (bench/run_gpu.sh sets it once the CUDA extension is built): a
  test skipped because the CUDA backend is unavailable (:data:`CUDA_UNAVAILABLE`) fails instead.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import pytest

MAX_FAILURES = 50
MAX_ERROR_CHARS = 3000
WRITE_EVERY_S = 1.0
_counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "incomplete": True, "exitstatus": None,
           "failures": [], "skip_reasons": {}, "tests": {}}
_last_write = [0.0]


def _failure(report) -> None:
    if len(_counts["failures"]) < MAX_FAILURES:
        text = getattr(report, "longreprtext", "") or str(report.longrepr)
        _counts["failures"].append({"test": report.nodeid, "when": getattr(report, "when", "collect"), "error": text[-MAX_ERROR_CHARS:]})


def _skip(report) -> None:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason[:300]
    _counts["skip_reasons"][reason] = _counts["skip_reasons"].get(reason, 0) + 1


def _write(force: bool = True) -> None:
    path = os.environ.get("SSA_FLASH_TESTS_JSON")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist the controller counts
        return
    now = time.monotonic()
    if not force and now - _last_write[0] < WRITE_EVERY_S:
        return
    _last_write[0] = now
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_counts, f)
    os.replace(tmp, path)


_running: dict = {}  # node id -> its entry until its teardown is reported


def _record(report) -> None:
    """The test's outcome over its phases, entered in ``tests`` when its teardown is reported (a
    test stopped by a time limit mid-call is not entered: never run): a failed call is "failed",
    a failed setup or teardown "error" (unless the call failed), a skip "skipped", else "passed";
    durations add up. xdist's report of a crashed worker (no phase) enters its test as failed."""
    entry = _running.setdefault(report.nodeid, {"outcome": "passed", "duration_s": 0.0})
    entry["duration_s"] = round(entry["duration_s"] + float(getattr(report, "duration", 0.0) or 0.0), 3)
    if report.failed:
        if report.when != "teardown" or entry["outcome"] != "failed":
            entry["outcome"] = "error" if report.when in ("setup", "teardown") else "failed"
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    if report.when not in ("setup", "call"):
        _counts["tests"][report.nodeid] = _running.pop(report.nodeid)


def pytest_configure(config):
    if os.environ.get("SSA_FLASH_TESTS_JSON") and not os.environ.get("PYTEST_XDIST_WORKER"):
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum, frame):  # `timeout` stops the run: keep what it has seen
            _write()
            signal.signal(signal.SIGTERM, previous if callable(previous) else signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        try:
            signal.signal(signal.SIGTERM, on_term)
        except ValueError:  # not the main thread
            pass


def pytest_runtest_logreport(report):
    _record(report)
    if report.when == "call":
        if report.passed:
            _counts["passed"] += 1
        elif report.skipped:
            _counts["skipped"] += 1
            _skip(report)
        else:
            _counts["failed"] += 1
            _failure(report)
    elif report.failed:  # an error in setup or teardown
        _counts["failed"] += 1
        _counts["errors"] += 1
        _failure(report)
    elif report.skipped and report.when == "setup":
        _counts["skipped"] += 1
        _skip(report)
    else:
        _write(force=False)
        return
    _write(force=False)


def pytest_collectreport(report):
    if report.failed:  # a test module that does not import
        _counts["failed"] += 1
        _counts["errors"] += 1
        _failure(report)
        _write()


def pytest_sessionfinish(session, exitstatus):
    _counts["incomplete"] = False
    _counts["exitstatus"] = int(exitstatus)
    _write()


# --------------------------------------------------------------------------------------------
# Guards for GPU runs

# what torch's CUDA errors say (AcceleratorError / RuntimeError texts): after these the context
# of the process is unusable (sticky errors)
CUDA_ERROR = re.compile(r"CUDA error|device-side assert|illegal memory access|illegal instruction|"
                        r"unspecified launch failure|misaligned address|cudaError|CUBLAS_STATUS_EXECUTION_FAILED")
# skip reasons that mean "the CUDA backend did not load" (tests/cuda, tests/gpu_smoke, emulation.py)
CUDA_UNAVAILABLE = re.compile(r"CUDA backend unavailable|CUDA extension|backend='cuda' is unavailable")
_POISONED = pytest.StashKey[str]()


def is_cuda_error(exc) -> bool:
    """Whether ``exc`` is a CUDA runtime error of the kind that poisons the process's context."""
    torch = sys.modules.get("torch")
    accel = getattr(torch, "AcceleratorError", None) if torch is not None else None
    return (accel is not None and isinstance(exc, accel)) or bool(CUDA_ERROR.search(f"{type(exc).__name__}: {exc}"))


def _errors_end_workers() -> bool:
    if os.environ.get("SSA_FLASH_CUDA_ERRORS_END_WORKERS", "0") == "1":
        return True
    torch = sys.modules.get("torch")
    try:
        return torch is not None and torch.cuda.is_available()
    except Exception:
        return False


def _skip_text(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and is_cuda_error(call.excinfo.value) and _errors_end_workers():
        item.config.stash.setdefault(_POISONED, f"{item.nodeid} ({call.when}): {call.excinfo.value}"[:500])
    if (report.skipped and os.environ.get("SSA_FLASH_REQUIRE_CUDA", "0") == "1"
            and CUDA_UNAVAILABLE.search(_skip_text(report))):
        report.outcome = "failed"
        report.longrepr = ("SSA_FLASH_REQUIRE_CUDA=1 (the CUDA extension was built for this run) but the test "
                           f"skipped: {_skip_text(report)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    why = item.config.stash.get(_POISONED, None)
    if why is None:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        sys.stderr.write(f"\npytest_summary: CUDA error in {why}\nthis worker's CUDA context is unusable: it "
                         "ends here (pytest-xdist starts another)\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(3)
    item.session.shouldstop = f"CUDA error in {why}: the CUDA context is unusable, later tests would fail"
