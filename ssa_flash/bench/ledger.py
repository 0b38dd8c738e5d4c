"""The GPU test ledger: every test id's last outcome on a GPU, kept in the repository
(``bench/results/gpu-ledger.json``) so that the GPU suite completes across sessions instead of
restarting: a session runs only what the ledger does not yet hold as passed at the current
kernels, failures and never-run tests first (``bench/run_gpu.sh``).

The file (schema 1; docs read it, keep this shape)::

    {"schema": 1,
     "kernel_hash": "<sha256 of the kernel sources at the last update>",
     "tests": {"<pytest node id>": {"outcome": "passed" | "failed" | "error" | "skipped",
                                    "commit": "<git sha>",
                                    "kernel_hash": "<kernel_hash() at that run>",
                                    "device": "<torch.cuda.get_device_name()>",
                                    "date": "YYYY-MM-DD",
                                    "duration_s": <float>}}}

* :func:`kernel_hash`: sha256 over the kernel sources, ``csrc/**/*.{h,cu,cuh,cpp}`` and
  ``ssa_flash/triton/*.py`` (each file's path relative to the root and its bytes, in path
  order). A pass recorded at another hash is stale: the kernels changed since.
* :func:`load` / :func:`save`, :func:`merge` (a run's outcomes, as
  :mod:`ssa_flash.bench.pytest_summary` writes them under ``"tests"``, into the ledger),
  :func:`pending` (of some node ids, those still to run, in the order to run them: failed and
  error first, then never run, then passed or skipped at other kernels; a pass or a skip at the
  current kernels is done).
* As a pytest plugin (``-p ssa_flash.bench.ledger`` with ``SSA_FLASH_LEDGER=<path>``): the
  collected tests are narrowed to :func:`pending` ones and put in that order (the rest are
  deselected). ``SSA_FLASH_LEDGER_ALL=1`` keeps every test but still puts pending ones first.
* ``python -m ssa_flash.bench.ledger hash | merge | pending | summary``: the same from the shell
  (``--help``).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional

SCHEMA = 1
ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_PATH = ROOT / "bench" / "results" / "gpu-ledger.json"
KERNEL_PATTERNS = ("csrc/**/*.h", "csrc/**/*.cu", "csrc/**/*.cuh", "csrc/**/*.cpp", "ssa_flash/triton/*.py")
OUTCOMES = ("passed", "failed", "error", "skipped")
# run order of pending tests (lower first)
_FAILED, _NEVER, _STALE = 0, 1, 2


def kernel_files(root=None) -> List[Path]:
    """The kernel sources :func:`kernel_hash` reads, sorted by their path under ``root``."""
    root = Path(root or ROOT)
    found = {p for pattern in KERNEL_PATTERNS for p in root.glob(pattern) if p.is_file()}
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def kernel_hash(root=None) -> str:
    """sha256 (hex) of the kernel sources under ``root`` (default: this checkout)."""
    root = Path(root or ROOT)
    h = hashlib.sha256()
    for path in kernel_files(root):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def session_hash() -> str:
    """``SSA_FLASH_KERNEL_HASH`` when set (bench/run_gpu.sh computes the hash once, at its start:
    sources edited during a run do not split it), else :func:`kernel_hash` of this checkout."""
    return os.environ.get("SSA_FLASH_KERNEL_HASH") or kernel_hash()


def empty() -> dict:
    return {"schema": SCHEMA, "kernel_hash": "", "tests": {}}


def load(path=None) -> dict:
    """The ledger at ``path`` (default ``bench/results/gpu-ledger.json``); an empty one when the file
    does not exist. Raises ValueError on another schema."""
    path = Path(path or DEFAULT_PATH)
    if not path.exists():
        return empty()
    with open(path) as f:
        data = json.load(f)
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: ledger schema {data.get('schema')!r}, this code reads {SCHEMA}")
    data.setdefault("kernel_hash", "")
    data.setdefault("tests", {})
    return data


def save(ledger: dict, path=None) -> None:
    """Writes ``ledger`` (node ids sorted, one per line: small diffs) atomically."""
    path = Path(path or DEFAULT_PATH)
    path.parent.mkdir(parents=True, exist_ok=True)
    tests = ledger.get("tests", {})
    lines = [f"  {json.dumps(k)}: {json.dumps(tests[k], sort_keys=True)}" for k in sorted(tests)]
    body = "{\n" + ",\n".join(lines) + "\n}" if lines else "{}"
    text = '{"schema": %d, "kernel_hash": %s, "tests": %s}\n' % (SCHEMA, json.dumps(ledger.get("kernel_hash", "")), body)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def git_commit(root=None) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=str(root or ROOT), capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def merge(ledger: dict, results: Mapping[str, Mapping], *, commit: str, kernel_hash: str, device: str,
          date: Optional[str] = None) -> dict:
    """``ledger`` updated in place with ``results`` (node id -> ``{"outcome", "duration_s"}``, as
    in :mod:`ssa_flash.bench.pytest_summary`'s ``"tests"``) run at ``commit`` / ``kernel_hash`` on
    ``device``; returns it. Each run replaces that test's entry (the last outcome is what counts)."""
    date = date or datetime.date.today().isoformat()
    tests = ledger.setdefault("tests", {})
    for node, res in results.items():
        outcome = res.get("outcome")
        if outcome not in OUTCOMES:
            continue
        tests[node] = {"outcome": outcome, "commit": commit, "kernel_hash": kernel_hash, "device": device,
                       "date": date, "duration_s": round(float(res.get("duration_s") or 0.0), 3)}
    ledger["schema"] = SCHEMA
    ledger["kernel_hash"] = kernel_hash
    return ledger


def _rank(entry: Optional[Mapping], current: str) -> Optional[int]:
    """Run order of a test with ledger ``entry`` at kernel hash ``current``; None when done."""
    if entry is None:
        return _NEVER
    if entry.get("outcome") in ("failed", "error"):
        return _FAILED
    if entry.get("kernel_hash") != current:
        return _STALE
    return None  # passed or skipped at these kernels


def pending(ledger: Mapping, node_ids: Iterable[str], current_hash: Optional[str] = None) -> List[str]:
    """Of ``node_ids``, those the ledger does not hold as passed (or skipped) at ``current_hash``
    (default: :func:`session_hash`), in run order: failed / error, never run,
    stale; the given order within each group."""
    current = session_hash() if current_hash is None else current_hash
    tests = ledger.get("tests", {})
    ranked = [(r, i, n) for i, n in enumerate(node_ids) if (r := _rank(tests.get(n), current)) is not None]
    return [n for _, _, n in sorted(ranked)]


def summary(ledger: Mapping, current_hash: Optional[str] = None) -> Dict[str, int]:
    """Counts of the ledger's entries: outcome at the current kernels, and ``stale`` (any
    outcome at other kernels)."""
    current = session_hash() if current_hash is None else current_hash
    out = {k: 0 for k in (*OUTCOMES, "stale")}
    for entry in ledger.get("tests", {}).values():
        out["stale" if entry.get("kernel_hash") != current else entry.get("outcome", "failed")] += 1
    return out


# --------------------------------------------------------------------------------------------
# pytest plugin: -p ssa_flash.bench.ledger with SSA_FLASH_LEDGER=<path>


def _hookimpl(**kw):
    try:
        import pytest
    except ImportError:  # the module works without pytest (the command line)
        return lambda fn: fn
    return pytest.hookimpl(**kw)


@_hookimpl(trylast=True)  # after tests/conftest.py's own ordering
def pytest_collection_modifyitems(session, config, items):
    path = os.environ.get("SSA_FLASH_LEDGER")
    if not path:
        return
    ledger = load(path)
    current = session_hash()
    order = {n: i for i, n in enumerate(pending(ledger, [it.nodeid for it in items], current))}
    keep_all = os.environ.get("SSA_FLASH_LEDGER_ALL", "0") not in ("", "0")
    selected = [it for it in items if it.nodeid in order]
    selected.sort(key=lambda it: order[it.nodeid])
    if keep_all:
        selected += [it for it in items if it.nodeid not in order]
    else:
        done = [it for it in items if it.nodeid not in order]
        if done:
            config.hook.pytest_deselected(items=done)
    items[:] = selected


def pytest_report_header(config):
    path = os.environ.get("SSA_FLASH_LEDGER")
    if path:
        return f"ssa_flash ledger: {path} (running only tests not passed at kernel hash {session_hash()[:12]})"
    return None


# --------------------------------------------------------------------------------------------
# command line


def _device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except Exception:
        pass
    return "cpu"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssa_flash.bench.ledger", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("hash", help="print the kernel sources' hash")
    m = sub.add_parser("merge", help="fold pytest_summary JSON files' outcomes into the ledger")
    m.add_argument("results", nargs="+", help="files written by ssa_flash.bench.pytest_summary")
    m.add_argument("--ledger", default=str(DEFAULT_PATH))
    m.add_argument("--device", default=None, help="default: torch.cuda.get_device_name() (or 'cpu')")
    m.add_argument("--commit", default=None)
    m.add_argument("--kernel-hash", default=None)
    m.add_argument("--date", default=None)
    q = sub.add_parser("pending", help="print the node ids (one a line, from stdin) still to run, in order")
    q.add_argument("--ledger", default=str(DEFAULT_PATH))
    s = sub.add_parser("summary", help="counts of the ledger's outcomes at the current kernels")
    s.add_argument("--ledger", default=str(DEFAULT_PATH))
    args = p.parse_args(argv)
    if args.cmd == "hash":
        print(kernel_hash())
        return 0
    ledger = load(args.ledger)
    if args.cmd == "merge":
        results: Dict[str, dict] = {}
        for path in args.results:
            try:
                with open(path) as f:
                    results.update(json.load(f).get("tests", {}))
            except (OSError, ValueError) as err:
                print(f"ledger: skipping {path}: {err}", file=sys.stderr)
        merge(ledger, results, commit=args.commit or git_commit(), kernel_hash=args.kernel_hash or session_hash(),
              device=args.device or _device_name(), date=args.date)
        save(ledger, args.ledger)
        print(f"ledger {args.ledger}: {len(results)} outcomes merged; at these kernels: {summary(ledger)}")
        return 0
    if args.cmd == "pending":
        ids = [line.strip() for line in sys.stdin if line.strip() and "::" in line]
        print("\n".join(pending(ledger, ids)))
        return 0
    print(json.dumps(summary(ledger)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
