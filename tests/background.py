"""Slow build work of the test session, started as soon as collection ends and run while the
interpreter tests run: nvcc / NVRTC compiles of csrc/, the CPU emulator of the CUDA kernels, the
static audit's Triton and nvcc compiles (subprocesses). On a 2-core CI machine the interpreter
tests keep one core busy and these keep the other one busy, instead of each module starting its
compiles when its first test runs and the session waiting for them.

A test module opts in with a module-level function ``prebuild(items)`` that calls :func:`submit`
for each job its selected tests (``items``, pytest's) will need; tests/conftest.py calls it after
collection and runs such modules' tests last. The fixture calls
:func:`submit` with the same key (which returns the job already started, or starts it when
``prebuild`` did not run, e.g. ``python tests/x/test_y.py``) and ``.result()``:

    def prebuild(items):
        if any("emulator" in item.fixturenames for item in items):
            background.submit("emulator", _build, ...)

    @pytest.fixture(scope="session")
    def emulator():
        return background.submit("emulator", _build, ...).result()

Jobs run on ``cpu_count - 1`` worker threads (at least one; the jobs themselves are mostly
subprocesses, which release the GIL). A thread waiting for a job's result that has not started
runs it itself, and while it waits for a running one it runs other queued jobs, so no core idles
while the session waits. Keys are global to the session: one build per key, shared by every module.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional

_lock = threading.Condition()
_queue: List["Job"] = []
_jobs: Dict[str, "Job"] = {}
_workers: List[threading.Thread] = []
_root: Optional[Path] = None


class Job:
    """One piece of work: ``fn(*args, **kwargs)`` run once; :meth:`result` returns its value or
    raises its exception."""

    def __init__(self, key: str, fn: Callable, args, kwargs):
        self.key, self._fn, self._args, self._kwargs = key, fn, args, kwargs
        self.state = "queued"  # -> "running" -> "done"
        self._value = self._error = None

    def _run(self):
        try:
            self._value = self._fn(*self._args, **self._kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised by result()
            self._error = err
        with _lock:
            self.state = "done"
            _lock.notify_all()

    def done(self) -> bool:
        return self.state == "done"

    def result(self):
        while True:
            with _lock:
                if self.state == "done":
                    break
                # run this job (if still queued), else another queued one, rather than idle
                job = self if self.state == "queued" else (_queue[0] if _queue else None)
                if job is None:
                    _lock.wait()
                    continue
                _queue.remove(job)
                job.state = "running"
            job._run()
        if self._error is not None:
            raise self._error
        return self._value


def _worker():
    while True:
        with _lock:
            while not _queue:
                _lock.wait()
            job = _queue.pop(0)
            job.state = "running"
        job._run()


def workers() -> int:
    """Background threads: all cores but the one the test session runs on."""
    return max(1, (os.cpu_count() or 1) - 1)


def submit(key: str, fn: Callable, *args, **kwargs) -> Job:
    """The job ``key``: started now (queued behind earlier ones) unless it already was."""
    with _lock:
        job = _jobs.get(key)
        if job is None:
            job = _jobs[key] = Job(key, fn, args, kwargs)
            _queue.append(job)
            while len(_workers) < workers():
                thread = threading.Thread(target=_worker, name=f"tests-background-{len(_workers)}", daemon=True)
                thread.start()
                _workers.append(thread)
            _lock.notify_all()
        return job


def finish():
    """End of the session: drops the jobs not started (a ``-k`` selection need not build what
    it does not use) and waits for the running ones (their subprocesses write into :func:`tmpdir`)."""
    with _lock:
        _queue.clear()
        running = [job for job in _jobs.values() if job.state == "running"]
    for job in running:
        with _lock:
            while job.state != "done":
                _lock.wait()


def tmpdir(name: str) -> Path:
    """A fresh folder for a job's outputs (under one temporary root, removed at exit)."""
    global _root
    with _lock:
        if _root is None:
            _root = Path(tempfile.mkdtemp(prefix="ssa_flash_tests_"))
            atexit.register(shutil.rmtree, _root, True)
    return Path(tempfile.mkdtemp(prefix=f"{name}_", dir=_root))
