"""pytest plugin writing the test counts to a JSON file as the run goes (so that a run killed by a
time limit still leaves its counts), for ``python -m ssa_flash.bench --gpu-tests-json``:

    SSA_FLASH_TESTS_JSON=out.json python -m pytest -p ssa_flash.bench.pytest_summary tests

Writes ``{"passed", "failed", "skipped", "errors", "incomplete", "exitstatus"}``: ``failed``
counts failed tests and errors in setup/teardown (``errors`` counts the latter alone); xfailed
tests count as skipped, xpassed as passed; ``incomplete`` stays true unless the session finished.
"""
from __future__ import annotations

import json
import os

_counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "incomplete": True, "exitstatus": None}


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
        else:
            _counts["failed"] += 1
    elif report.failed:  # an error in setup or teardown
        _counts["failed"] += 1
        _counts["errors"] += 1
    elif report.skipped and report.when == "setup":
        _counts["skipped"] += 1
    else:
        return
    _write()


def pytest_collectreport(report):
    if report.failed:  # a test module that does not import
        _counts["failed"] += 1
        _counts["errors"] += 1
        _write()


def pytest_sessionfinish(session, exitstatus):
    _counts["incomplete"] = False
    _counts["exitstatus"] = int(exitstatus)
    _write()
