"""``python -m ssa_flash.bench.verified``: writes docs/verified.md, the one page saying what has
been run on which hardware (CPU or GPU model), with which backend, when and at which commit.

Generated from committed records only, so that no document restates (and lets rot) a claim about
what was verified:

* the benchmark sessions' results, ``bench/results/<date>-<gpu>.json``, and the pytest counts
  their session logs keep (``bench/results/<date>-<gpu>-logs/**/*tests.json``);
* the GPU test ledger, ``bench/results/gpu-ledger.json`` (:mod:`ssa_flash.bench.ledger`: each
  test id's last outcome on a GPU, with its device, date, commit and kernel hash), when it exists;
* the static audit's results, ``bench/results/audit-*.json`` (compiled on a CPU, nothing run).

What each backend *supports* (accepts) is docs/support.md; this page says what was *run*. The
CPU side is CI's: ``bash .ci/run`` runs the whole suite on every change (the backends' CPU modes
are described in :data:`CPU_MODES`). ``--check`` exits 1 when the committed page differs from
what the committed records give (tests/docs/test_verified.py does the same).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent.parent
PAGE = Path("docs") / "verified.md"
RESULTS = Path("bench") / "results"
LEDGER = RESULTS / "gpu-ledger.json"
HOST_SUFFIX = "-host.json"  # python -m ssa_flash.bench --host: host time per call, not benchmark rows
OUTCOMES = ("passed", "failed", "error", "skipped")

#: How each backend runs on a CPU, as the suite runs it in CI (docs/support.md says which dtypes
#: and features each accepts; tests/features.py's matrix takes every feature through each).
CPU_MODES = [
    ("`reference`", "PyTorch on the CPU (float64 is the specification the others are held to)",
     "float16, bfloat16, float32, float64", "`tests/reference/`, the feature matrix"),
    ("`triton`", "Triton's interpreter (`TRITON_INTERPRET=1`): the kernels' own code, run by numpy; "
     "bfloat16 inputs computed in float32, outputs and gradients rounded to bfloat16",
     "float16, bfloat16, float32, float64 (`gradcheck`)", "`tests/triton/`, the feature matrix"),
    ("`cuda`", "`nvcc` compiles of `csrc/` (sm_70 through NVRTC, sm_75, sm_80, sm_90a) and a CPU "
     "emulation of the compiled kernels' execution (`csrc/emu`)", "float16, bfloat16",
     "`tests/cuda/`, the feature matrix (emulated)"),
]

#: What the CPU suite checks, by area: (what, how it runs on the CPU, where the tests are).
CPU_CHECKS = [
    ("Triton kernels, every variant (softmax, SSA, logit scale; each with and without the adaptive "
     "temperature), forward + backward against the reference and SDPA / "
     "FlexAttention; float64 `gradcheck` of q, k, v, b, n; masks, causal, GQA, odd head dims, "
     "`Lq != Lk`, length 1, non-contiguous inputs, empty rows", "Triton's interpreter",
     "`tests/triton/`"),
    ("dropout (the Philox mask against the reference given the same mask, keep rate, "
     "reproducibility, `gradcheck` at a fixed seed), `window_size`, packed batches "
     "(`varlen_attention`, with dropout and windows), KV-cache decoding (`attention_with_kvcache`, "
     "split-KV, bottom-right windows)", "Triton's interpreter, the reference",
     "`tests/triton/`, `tests/ops/`"),
    ("attention sinks and soft-capping", "the reference, Triton's interpreter, the CUDA kernels' "
     "CPU emulation", "`tests/*/test_*sinks*`"),
    ("custom ops and `torch.compile(fullgraph=True)`, `nn.SSAttention`, the transformers "
     "integration (GPT-2, Llama)", "CPU", "`tests/ops/`, `tests/nn/`, `tests/integrations/`"),
    ("ring attention (`ssa_flash.distributed`): every variant, causal zig-zag, gradients of q, k, v, "
     "b, n against the reference; DDP / FSDP2", "gloo, 2 and 4 processes (Triton's interpreter, the "
     "reference)", "`tests/distributed/`"),
    ("CUDA C++ kernels (`csrc/`): compiles without spills outside the listed ones; numerics of every "
     "variant and feature the backend accepts against the reference", "`nvcc` (sm_75, sm_80, sm_90a; "
     "sm_70 through the CUDA 12.9 NVRTC where installed), the CPU emulation (`csrc/emu`)", "`tests/cuda/`"),
    ("static audit: every Triton specialisation compiled for sm_80 / sm_90 (the installed Triton; in "
     "CI also the audited floor and the GPU machines' version), registers, spills, instruction mix, "
     "bound model; each GPU family's first tile choices fit its shared memory and compile without "
     "spills", "compiled on the CPU, nothing run", "`tests/audit/`"),
    ("first contact with a GPU: launches on the tensors' device, `deterministic=True` fixing the "
     "tiles, the tuning cache, TF32 for float32, the self-check on GPU machines, the CUDA build "
     "fallback and kernel-image check", "the GPU side faked ([reliability.md](reliability.md))",
     "`tests/triton/`, `tests/cli/`, `tests/packaging/`"),
    ("`python -m ssa_flash` (self-check), `python -m ssa_flash.bench --smoke`", "CPU (interpreter "
     "timings: nothing about speed)", "`tests/cli/`, `tests/bench/`"),
]

#: Test files whose name says the feature they take through a backend (the rest: by folder).
FEATURE_FILES = {
    "test_dropout": "dropout", "test_window": "local window", "test_varlen": "packed batches",
    "test_kvcache": "KV-cache decoding", "sinks_softcap": "sinks, soft-capping",
    "test_distributed_sinks": "sinks, soft-capping (key shards)", "features": "feature matrix (every feature)",
    "test_gradcheck": "float64 gradcheck", "test_precision": "precision (TF32, fast math)",
    "test_edge_cases": "edge cases", "test_gpu_smoke": "GPU smoke tier (every kernel family)",
    "test_custom_op": "custom ops, torch.compile", "test_transformers": "transformers integration",
    "test_launch_device": "devices, streams, determinism", "test_cuda_backend": "CUDA C++ backend on a GPU",
    "test_triton_entropy": "row entropy", "test_distributed": "ring attention",
}


def _load(path: Path):
    with open(path) as fh:
        return json.load(fh)


def _rel(path: Path, root: Path) -> str:
    return Path(path).resolve().relative_to(root.resolve()).as_posix()


def _link(path: str, text: Optional[str] = None) -> str:
    """A markdown link from docs/ to the repository path ``path``."""
    return f"[{text or '`' + path + '`'}](../{path})"


def backend_of(test_id: str) -> str:
    """The backend a test id exercises, from its file: ``cuda`` (tests/cuda/, the CUDA smoke or
    emulation tests), ``triton``, ``reference``, else ``other`` (public functions, modules,
    integrations: whichever backend "auto" takes)."""
    path = test_id.split("::", 1)[0]
    parts = path.split("/")
    folder = parts[1] if len(parts) > 2 else ""
    name = parts[-1]
    if folder == "cuda" or "cuda" in name:
        return "cuda"
    if folder in ("triton", "reference"):
        return folder
    return "other"


def feature_of(test_file: str) -> str:
    stem = Path(test_file).stem
    for key, feature in FEATURE_FILES.items():
        if key in stem:
            return feature
    return "-"


def _counts(d: dict) -> str:
    """``passed / failed / skipped (+ errors)`` of a pytest summary, incomplete runs flagged."""
    text = f"{d.get('passed', 0)} passed, {d.get('failed', 0)} failed, {d.get('skipped', 0)} skipped"
    if d.get("errors"):
        text += f", {d['errors']} errors"
    if d.get("incomplete"):
        text += " (stopped by its time limit)"
    return text


def _short(sha: Optional[str]) -> str:
    return f"`{sha[:7]}`" if sha else "-"


def _by_name(paths, suffix: str = ".json") -> List[str]:
    """Results files in the order of their names less ``suffix``: a later session of the same day
    and GPU, named by extending the earlier one's name (``<date>-<gpu>-session4.json`` beside
    ``<date>-<gpu>.json``, ``...-session4-host.json`` beside ``...-host.json``), comes after it
    (a plain sort puts ``-`` before ``.``, or compares ``host`` with ``session4``)."""
    def key(path: str) -> str:
        name = os.path.basename(path)
        return name[:-len(suffix)] if name.endswith(suffix) else name
    return sorted(paths, key=key)


def sessions(root: Path) -> List[dict]:
    """The benchmark sessions' results files (``bench/results/<date>-<gpu>[-<suffix>].json``: those
    holding a ``device`` and benchmark ``rows``, smoke runs left out), oldest first."""
    out = []
    for path in _by_name(glob.glob(str(root / RESULTS / "*.json"))):
        name = os.path.basename(path)
        if name.startswith("audit-") or name == LEDGER.name or name.endswith(HOST_SUFFIX):
            continue
        try:
            doc = _load(Path(path))
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and "device" in doc and "rows" in doc and not doc.get("smoke"):
            out.append({"path": Path(path), "doc": doc})
    return out


def _session_section(root: Path) -> List[str]:
    found = sessions(root)
    lines = ["## GPU sessions (committed results)", ""]
    if not found:
        return lines + ["No GPU session has committed results yet.", ""]
    lines += ["Each benchmark session's results file, the software it ran, what its pytest steps "
              "counted (how many tests, not which: see the ledger below for test ids) and what it "
              "timed.", "",
              "| date | device | commit | software | tests (all steps) | benchmark rows | results |",
              "|---|---|---|---|---|---|---|"]
    for s in found:
        d = s["doc"]
        rel = _rel(s["path"], root)
        soft = f"torch {d.get('torch', '?')}, Triton {d.get('triton', '?')}, CUDA {d.get('cuda', '?')}"
        tests = _counts(d["gpu_tests"]) if d.get("gpu_tests") else "none run"
        rows = Counter((r.get("impl"), r.get("dtype"), r.get("headdim")) for r in d.get("rows", []))
        impls = sorted({k[0] for k in rows})
        dtypes = sorted({k[1] for k in rows})
        dims = sorted({k[2] for k in rows})
        bench = (f"{sum(rows.values())}: {', '.join(impls)}; {', '.join(dtypes)}; head dim "
                 f"{', '.join(map(str, dims))}") if rows else "none"
        lines.append(f"| {d.get('date', '?')} | {d['device']} | {_short(d.get('git_commit'))} | {soft} | "
                     f"{tests} | {bench} | {_link(rel)} |")
    lines.append("")
    for s in found:
        logs = s["path"].with_name(s["path"].stem + "-logs")
        counts = sorted(glob.glob(str(logs / "**" / "*tests.json"), recursive=True))
        if not counts:
            continue
        lines += [f"Pytest steps of {_link(_rel(logs / 'README.md', root) if (logs / 'README.md').is_file() else _rel(logs, root), _rel(logs, root) + '/')} "
                  "(one file per step or call; the folder's README says what each ran):", "",
                  "| step | counts |", "|---|---|"]
        for path in counts:
            try:
                doc = _load(Path(path))
            except (OSError, ValueError):
                continue
            lines.append(f"| `{Path(path).relative_to(logs).as_posix()}` | {_counts(doc)} |")
        lines.append("")
    return lines


def _host_section(root: Path) -> List[str]:
    """The host-path measurements on a GPU (``<date>-<gpu>-host.json`` of ``python -m
    ssa_flash.bench --host``): per file, the shape and each row's host time beside SDPA's."""
    found = []
    for path in _by_name(glob.glob(str(root / RESULTS / f"*{HOST_SUFFIX}")), HOST_SUFFIX):
        try:
            doc = _load(Path(path))
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("rows") and doc.get("device"):
            found.append((Path(path), doc))
    if not found:
        return []
    lines = ["### Host time per call on a GPU", "",
             "`python -m ssa_flash.bench --host` (tiny shapes: the host's cost of a call, the device idle "
             "before each block of calls), median microseconds per call; SDPA's beside each row in the "
             "same run.", ""]
    for path, doc in found:
        shape = doc.get("shape", {})
        lines += [f"{_link(_rel(path, root))}: {doc['device']}, {doc.get('date', '?')}, torch {doc.get('torch', '?')}, "
                  f"Triton {doc.get('triton', '?')}; shape {', '.join(f'{k} {v}' for k, v in shape.items())}; "
                  f"{len(doc['rows'])} rows.", "",
                  "| impl | op | feature | pass | host us |", "|---|---|---|---|---|"]
        lines += [f"| {r.get('impl')} | {r.get('op')} | {r.get('feature')} | {r.get('pass')} | {r['host_us']:.1f} |"
                  for r in doc["rows"] if isinstance(r.get("host_us"), (int, float))]
        lines.append("")
    return lines


def _ledger_section(root: Path) -> List[str]:
    path = root / LEDGER
    lines = ["## GPU test ledger (per test id)", ""]
    if not path.is_file():
        return lines + [f"No per-test GPU record exists yet: the ledger `{LEDGER.as_posix()}` "
                        "(`ssa_flash.bench.ledger`, kept by `bench/run_gpu.sh`) has not been "
                        "committed. Until it is, the session counts above are all there is: they "
                        "say how many tests passed on a GPU, not which ones, so no test, feature "
                        "or backend can be called verified on a GPU from them.", ""]
    doc = _load(path)
    tests: Dict[str, dict] = doc.get("tests", {})
    current = doc.get("kernel_hash")
    lines += [f"{_link(LEDGER.as_posix())}: each test's last outcome on a GPU. A pass recorded at "
              "another kernel hash than the ledger's latest (`" + (current or "?")[:12] + "`) is "
              "*stale*: the kernels changed after it ran.", ""]
    if not tests:
        return lines + ["The ledger holds no test yet.", ""]
    by_backend: Dict[str, Counter] = defaultdict(Counter)
    by_file: Dict[str, dict] = {}
    for tid, rec in sorted(tests.items()):
        outcome = rec.get("outcome", "?")
        stale = rec.get("kernel_hash") != current
        be = backend_of(tid)
        by_backend[be][outcome] += 1
        if stale:
            by_backend[be]["stale"] += 1
        f = tid.split("::", 1)[0]
        entry = by_file.setdefault(f, {"counts": Counter(), "devices": set(), "dates": set(), "commits": set()})
        entry["counts"][outcome] += 1
        if stale:
            entry["counts"]["stale"] += 1
        entry["devices"].add(rec.get("device", "?"))
        entry["dates"].add(rec.get("date", "?"))
        if rec.get("commit"):
            entry["commits"].add(rec["commit"][:7])

    def cells(c: Counter) -> str:
        return " | ".join(str(c.get(k, 0)) for k in (*OUTCOMES, "stale"))

    lines += ["| backend | passed | failed | error | skipped | of them stale |", "|---|---|---|---|---|---|"]
    for be in ("triton", "cuda", "reference", "other"):
        if be in by_backend:
            lines.append(f"| {be if be == 'other' else '`' + be + '`'} | {cells(by_backend[be])} |")
    lines += ["", "By test file (the backend from its folder; `other`: the public functions, modules and "
              "integrations, on whichever backend `\"auto\"` takes on a GPU):", "",
              "| test file | backend | feature | passed | failed | error | skipped | of them stale | device | dates | commits |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f, e in sorted(by_file.items()):
        dates = sorted(e["dates"])
        span = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
        lines.append(f"| `{f}` | {backend_of(f)} | {feature_of(f)} | {cells(e['counts'])} | "
                     f"{', '.join(sorted(e['devices']))} | {span} | {', '.join(f'`{c}`' for c in sorted(e['commits']))} |")
    bad = [(tid, rec) for tid, rec in sorted(tests.items()) if rec.get("outcome") in ("failed", "error")]
    lines.append("")
    if bad:
        lines += ["Failing on a GPU at their last run:", ""]
        lines += [f"* `{tid}`: {rec['outcome']} on {rec.get('device', '?')}, {rec.get('date', '?')}, "
                  f"commit {_short(rec.get('commit'))}" for tid, rec in bad]
        lines.append("")
    return lines


def _audit_section(root: Path) -> List[str]:
    found = sorted(glob.glob(str(root / RESULTS / "audit-*.json")))
    lines = ["## Static audit (compiled on a CPU; nothing ran on a GPU)", "",
             "`python -m ssa_flash.audit` compiles the kernels for a GPU target and reads the "
             "compiled code: registers, spills, instruction mix, a throughput bound. It checks "
             "that the kernels compile and what they compile to, not that they compute the right "
             "thing on hardware ([benchmarks.md](benchmarks.md#static-audit-no-gpu)).", ""]
    if not found:
        return lines + ["No audit results are committed.", ""]
    lines += ["| file | target | date | commit | Triton | Triton specialisations (with spills) | CUDA C++ kernels | selection |",
              "|---|---|---|---|---|---|---|---|"]
    for path in found:
        try:
            d = _load(Path(path))
        except (OSError, ValueError):
            continue
        res = d.get("results", [])
        spills = 0
        for r in res:
            chosen = r.get("chosen")
            configs = r.get("configs") or []
            if chosen is not None and chosen < len(configs) and configs[chosen].get("spills"):
                spills += 1
        cuda = d.get("cuda") or {}
        cuda_text = (f"{len(cuda.get('kernels', []))}" if cuda.get("kernels") is not None
                     else (f"skipped ({cuda['skipped']})" if cuda.get("skipped") else "not run"))
        argv = (d.get("selection") or {}).get("argv")
        sel = f"`{' '.join(argv)}`" if argv else "all"
        lines.append(f"| {_link(_rel(Path(path), root), '`' + os.path.basename(path) + '`')} | {d.get('target', '?')} | "
                     f"{str(d.get('date', '?'))[:10]} | {_short(d.get('git_commit'))} | {d.get('triton', '?')} | "
                     f"{len(res)} ({spills}) | {cuda_text} | {sel} |")
    return lines + [""]


def render(root=None) -> str:
    """The page, from the committed records under ``root`` (default: this checkout)."""
    root = Path(root or ROOT)
    lines = [
        "# What has been verified where",
        "",
        "<!-- Generated by `python -m ssa_flash.bench.verified` from bench/results/ (the sessions' results",
        "     and logs, the GPU test ledger, the audit); do not edit by hand: tests/docs/test_verified.py",
        "     fails until the page is regenerated. -->",
        "",
        "The one place saying what has been *run* on which hardware: the CPU side by CI, the GPU side "
        "from the committed GPU records below (device, date, commit of each). What each backend "
        "*accepts* (features, dtypes, head dims, architectures) is [support.md](support.md); "
        "\"yes\" there is not a claim that it ran on that hardware. Other documents link here "
        "instead of restating it.",
        "",
        "## On the CPU (every change: CI)",
        "",
        "`bash .ci/run` installs the package as the README says and runs the whole suite, "
        "`python -m pytest tests -q`, on a CPU (no GPU): every feature of "
        "[support.md](support.md#features-by-backend) through each backend that accepts it "
        "(`tests/features.py`'s matrix), against the float64 reference with FlashAttention's "
        "error rule. How each backend runs there:",
        "",
        "| backend | how it runs on a CPU | dtypes the suite checks there | where |",
        "|---|---|---|---|",
    ]
    lines += [f"| {be} | {how} | {dtypes} | {where} |" for be, how, dtypes, where in CPU_MODES]
    lines += ["", "What the CPU suite checks, by area:", "", "| what | how, on the CPU | tests |", "|---|---|---|"]
    lines += [f"| {what} | {how} | {where} |" for what, how, where in CPU_CHECKS]
    lines += ["", "Speed and memory measured on a CPU say nothing about the kernels (the interpreter "
              "and the emulation are orders of magnitude slower than a GPU).", ""]
    lines += _session_section(root)
    lines += _host_section(root)
    lines += _ledger_section(root)
    lines += _audit_section(root)
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssa_flash.bench.verified", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(ROOT), help="the checkout whose records to read (default: this one)")
    p.add_argument("--out", help=f"where to write the page (default: <root>/{PAGE.as_posix()}; - for stdout)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page differs")
    args = p.parse_args(argv)
    root = Path(args.root)
    text = render(root)
    out = Path(args.out) if args.out and args.out != "-" else root / PAGE
    if args.check:
        same = out.is_file() and out.read_text() == text
        if not same:
            print(f"{out} is out of date: run python -m ssa_flash.bench.verified", file=sys.stderr)
        return 0 if same else 1
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
