"""pytest plugin writing the test counts to a JSON file as the run goes (so that a run killed by a
time limit still leaves its counts), for ``python -m ssa_flash.bench --gpu-tests-json``:

    SSA_FLASH_TESTS_JSON=out.json python -m pytest -p ssa_flash.bench.pytest_summary tests

Writes ``{"passed", "failed", "skipped", "errors", "incomplete", "exitstatus", "failures",
"skip_reasons"}``: ``failed`` counts failed tests and errors in setup/teardown (``errors`` counts
the latter alone); xfailed tests count as skipped, xpassed as passed; ``incomplete`` stays true
unless the session finished. ``failures``: the first ``MAX_FAILURES`` failures as they happen,
``{"test", "when", "error"}`` with the end of the error's report (``MAX_ERROR_CHARS``), so that a
run stopped by a time limit still says what failed and why (pytest prints its summary only at the
end, pytest-xdist's tracebacks too); ``skip_reasons``: reason -> count.
"""
from __future__ import annotations

import json
import os

MAX_FAILURES = 50
MAX_ERROR_CHARS = 3000
_counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "incomplete": True, "exitstatus": None,
           "failures": [], "skip_reasons": {}}


def _failure(report) -> None:
    if len(_counts["failures"]) < MAX_FAILURES:
        text = getattr(report, "longreprtext", "") or str(report.longrepr)
        _counts["failures"].append({"test": report.nodeid, "when": getattr(report, "when", "collect"), "error": text[-MAX_ERROR_CHARS:]})


def _skip(report) -> None:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason[:300]
    _counts["skip_reasons"][reason] = _counts["skip_reasons"].get(reason, 0) + 1


def _write() -> None:
    path = os.environ.get("SSA_FLASH_TESTS_JSON")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist the controller counts
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_counts, f)
    os.replace(tmp, path)


def pytest_runtest_logreport(report):
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
        return
    _write()


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
