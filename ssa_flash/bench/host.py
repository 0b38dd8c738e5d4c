"""The host path's cost: ``python -m ssa_flash.bench --host``.

Per public function (softmax, SSA, adaptive temperature, SSA + adaptive) and feature (none, a
boolean mask, dropout, a window, a packed variable-length batch, a KV cache), backend (Triton,
CUDA C++) and pass (forward; forward + backward), the host time of one call: the median wall time
from the call to its return, after warm-up, with the device idle before each call (so a GPU's
queue never makes the host wait). SDPA's host time is measured the same way beside every row, in
interleaved blocks (so both see the same machine load), and every row gives the ratio to it (forward rows to SDPA's forward, forward +
backward rows to SDPA's forward + backward; a feature SDPA has is compared with SDPA using it).

* On a GPU the launches are real: tiny shapes, so each kernel is short. Then, at the targets'
  shape (B x L = 16k tokens, 16 heads, D 128, L 1k), the split of one call into its kernels' own
  time (``torch.profiler``, the sum of the kernels' durations) and its end-to-end time (CUDA
  events around back-to-back calls): a row whose end-to-end time exceeds 1.1x its kernels' is
  host-bound.
* Without a GPU the Triton launcher runs in stub mode (``ssa_flash.triton.direct.stub``): every
  host step of a GPU call (validation, backend choice, autograd, launch plans, argument packing,
  the specialisation key of each direct launch) except the launch itself, which does nothing; the
  CUDA C++ backend runs over a stub extension whose functions only allocate their outputs.
  Triton's or the driver's own launch cost is therefore not included on the CPU. One intra-op
  thread (tiny CPU tensors; SDPA's OpenMP threads only add noise at these sizes).

Beside each row's time, ``python_calls``: the Python function calls one call makes after warm-up
(:func:`python_calls`, ``sys.setprofile``'s ``call`` events: functions written in Python, the
package's and torch's; C functions are not counted), the host path's length independent of the
machine's speed (:data:`CALL_LIMITS`: the budget, tests/ops/test_host_path.py holds the plain rows
to it).

Writes ``<out>/<date>-<device>-host.json`` and prints a table.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
from typing import Callable, List, Optional

import torch

from ..scores import VARIANTS

OPS = tuple(VARIANTS)
FEATURES = ("plain", "mask", "dropout", "window", "varlen", "kvcache")
CUDA_FEATURES = ("plain", "mask", "dropout", "window")  # the CUDA C++ kernels' layouts are dense


def _op_kwargs(op: str) -> dict:
    """The score function of variant ``op`` with its parameters as numbers (the registry's example
    values: SSA's b = 1, n = 1.5), and the temperature switch."""
    variant = VARIANTS[op]
    return dict(score=variant.score.name, score_params=variant.score.example,
                adaptive_temperature=variant.adaptive)


def _attend(op: str):
    import ssa_flash

    return ssa_flash.attention


class _StubExtension:
    """The CUDA extension's three functions allocating their outputs and computing nothing (the
    shapes of csrc/binding.cpp's returns): the CUDA C++ backend's host path without a GPU."""

    @staticmethod
    def fwd(q, k, v, *args, **kw):
        stat = q.new_empty(q.shape[:-1], dtype=torch.float32)
        return q.new_empty((*q.shape[:-1], v.shape[-1])), stat

    @staticmethod
    def row_entropy(q, k, *args, **kw):
        return (q.new_empty(q.shape[:-1], dtype=torch.float32), q.new_empty(q.shape[:-1], dtype=torch.float32))

    @staticmethod
    def bwd(dout, q, k, v, out, lse, dlse, mask, score_params, *args, **kw):
        B, H, L, D = q.shape
        parts = [q.new_empty((B, H, 1), dtype=torch.float32) for _ in score_params]
        # the fused backward's float32 dQ accumulator, which the backend crops, scales and casts
        return (q.new_empty((B, H, L, D), dtype=torch.float32), torch.empty_like(k), torch.empty_like(v), parts,
                q.new_empty((B, H, L, 6), dtype=torch.float32))


@contextmanager
def stubbed_launches(arch: int = 90):
    """Stub mode for both backends (see the module docstring)."""
    from ..backends import cuda_backend
    from ..triton import direct

    with direct.stub(arch), cuda_backend.emulated(_StubExtension()):
        yield


class Case:
    """One row: ``fn()`` runs one call (and its backward for ``fwd_bwd``)."""

    def __init__(self, op: str, impl: str, feature: str, pass_: str, fn: Callable[[], object]):
        self.op, self.impl, self.feature, self.pass_, self.fn = op, impl, feature, pass_, fn


def _inputs(device, dtype, B, H, L, D, requires_grad):
    gen = torch.Generator(device="cpu").manual_seed(0)
    return [torch.randn(B, H, L, D, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
            .requires_grad_(requires_grad) for _ in range(3)]


def _feature_kwargs(feature: str, L: int, device) -> dict:
    if feature == "mask":
        return {"attn_mask": torch.ones(L, L, dtype=torch.bool, device=device).tril_()}
    if feature == "dropout":
        return {"dropout_p": 0.1}
    if feature == "window":
        return {"window_size": (L // 4, 0)}
    return {}


def cases(device, dtype, B: int, H: int, L: int, D: int, backends=("triton", "cuda"),
          ops=OPS, features=FEATURES, passes=("fwd", "fwd_bwd")) -> List[Case]:
    """The rows, SDPA's first (per feature SDPA has: none, a mask, dropout)."""
    import torch.nn.functional as F

    out: List[Case] = []
    # SDPA on the CPU in float32: its float16 CPU kernels compute slowly enough to hide its host
    # cost, which float32 at these sizes shows (the harder baseline)
    sdpa_dtype = torch.float32 if torch.device(device).type == "cpu" else dtype
    qf, kf, vf = _inputs(device, sdpa_dtype, B, H, L, D, False)
    qg, kg, vg = _inputs(device, sdpa_dtype, B, H, L, D, True)
    grad = torch.randn(B, H, L, D, dtype=torch.float32).to(device=device, dtype=sdpa_dtype)

    def fwd_bwd(call, q, k, v, grad):
        def run():
            call(q, k, v).backward(grad)
        return run

    for feature in ("plain", "mask", "dropout"):
        if feature not in features:
            continue
        kw = _feature_kwargs(feature, L, device)
        causal = feature != "mask"

        def sdpa(q, k, v, kw=kw, causal=causal):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)

        if "fwd" in passes:
            out.append(Case("softmax", "sdpa", feature, "fwd", lambda sdpa=sdpa, t=(qf, kf, vf): sdpa(*t)))
        if "fwd_bwd" in passes:
            out.append(Case("softmax", "sdpa", feature, "fwd_bwd", fwd_bwd(sdpa, qg, kg, vg, grad)))

    # ours in the benchmark's dtype (new names: the baselines above keep theirs)
    xf, xk, xv = _inputs(device, dtype, B, H, L, D, False)
    yq, yk, yv = _inputs(device, dtype, B, H, L, D, True)
    ygrad = grad.to(dtype)
    for backend in backends:
        for feature in features:
            if backend == "cuda" and feature not in CUDA_FEATURES:
                continue
            for op in ops:
                attend, kw = _attend(op), _op_kwargs(op)
                if feature in ("varlen", "kvcache"):
                    out.extend(_layout_cases(feature, op, backend, kw, device, dtype, B, H, L, D, passes))
                    continue
                kw = dict(kw, backend=backend, **_feature_kwargs(feature, L, device))
                causal = feature != "mask"

                def call(q, k, v, attend=attend, kw=kw, causal=causal):
                    return attend(q, k, v, is_causal=causal, **kw)

                if "fwd" in passes:
                    out.append(Case(op, f"ssa_flash.{backend}", feature, "fwd", lambda call=call: call(xf, xk, xv)))
                if "fwd_bwd" in passes:
                    out.append(Case(op, f"ssa_flash.{backend}", feature, "fwd_bwd", fwd_bwd(call, yq, yk, yv, ygrad)))
    return out


def _layout_cases(feature, op, backend, kw, device, dtype, B, H, L, D, passes) -> List[Case]:
    import ssa_flash

    kw = dict(kw, backend=backend)
    if feature == "varlen":
        total = B * L
        cu = torch.arange(0, total + 1, L, dtype=torch.int32, device=device)
        qf, kf, vf = (t.reshape(total, H, D) for t in _inputs(device, dtype, 1, total, 1, H * D, False))
        qg, kg, vg = (t.detach().reshape(total, H, D).requires_grad_() for t in (qf, kf, vf))
        grad = torch.randn(total, H, D, dtype=torch.float32).to(device=device, dtype=dtype)

        def call(q, k, v):
            return ssa_flash.varlen_attention(q, k, v, cu, cu, L, L, is_causal=True, **kw)

        rows = []
        if "fwd" in passes:
            rows.append(Case(op, f"ssa_flash.{backend}", feature, "fwd", lambda: call(qf, kf, vf)))
        if "fwd_bwd" in passes:
            rows.append(Case(op, f"ssa_flash.{backend}", feature, "fwd_bwd", lambda: call(qg, kg, vg).backward(grad)))
        return rows
    # a decoding step: one query per sequence over a cache of L rows, L // 2 of them filled
    q = torch.randn(B, H, 1, D, dtype=torch.float32).to(device=device, dtype=dtype)
    kc, vc = _inputs(device, dtype, B, H, L, D, False)[:2]
    used = torch.full((B,), L // 2, dtype=torch.int32, device=device)
    if "fwd" not in passes:
        return []
    return [Case(op, f"ssa_flash.{backend}", feature, "fwd",
                 lambda: ssa_flash.attention_with_kvcache(q, kc, vc, cache_seqlens=used, is_causal=True, **kw))]


CALL_LIMITS = {"fwd": 40, "fwd_bwd": 100}
"""The host path's budget: Python function calls per forward and per forward + backward (every
variant, both backends), counted by :func:`python_calls` (the row's call wrapper in :func:`cases`
included)."""


def python_calls(fn: Callable[[], object], warmup: int = 5) -> int:
    """Python function calls made inside one ``fn()`` after ``warmup`` calls (``sys.setprofile``'s
    ``call`` events below ``fn``'s own frame: every Python frame, generator expressions and
    comprehensions included; C functions not). Deterministic for a given path, unlike a time:
    SDPA's forward row counts 1 (its wrapper in :func:`cases`)."""
    for _ in range(warmup):
        fn()
    count = [0]

    def profile(frame, event, arg):
        if event == "call":
            count[0] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return count[0] - 1  # fn's own frame is not counted


def host_time_us(fns: List[Callable[[], object]], device, reps: int = 200, per: int = 10) -> List[float]:
    """Median wall time of one call of each of ``fns`` in microseconds, measured in interleaved
    blocks of ``per`` calls (``reps`` calls of each in all), the device idle before each block:
    a row and its SDPA baseline see the same machine load."""
    cuda = torch.device(device).type == "cuda"
    for fn in fns:
        for _ in range(5):
            fn()
    samples: List[List[float]] = [[] for _ in fns]
    for _ in range(max(1, reps // per)):
        for i, fn in enumerate(fns):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(per):
                fn()
            samples[i].append((time.perf_counter() - start) / per)
    if cuda:
        torch.cuda.synchronize()
    return [statistics.median(s) * 1e6 for s in samples]


def kernel_split_us(fn: Callable[[], object], reps: int = 10) -> dict:
    """On a GPU: one call's end-to-end time (CUDA events around ``reps`` back-to-back calls) and
    its kernels' own time (``torch.profiler``: the sum of the device time of every kernel the
    calls ran, per call), in microseconds."""
    from torch.profiler import ProfilerActivity, profile

    from ..backends import _time_ms  # warm-up, then CUDA events around back-to-back calls

    e2e = _time_ms(fn, reps) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for evt in prof.key_averages():
        total += getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
    kernels = total / reps
    return {"e2e_us": e2e, "kernel_us": kernels, "host_bound": bool(e2e > 1.1 * kernels)}


def profile_calls(fn: Callable[[], object], device, calls: int = 200, top: int = 25) -> str:
    """cProfile of ``calls`` calls of ``fn`` (after warm-up): the ``top`` functions by their own
    time, as pstats prints them (paths shortened to the package or ``site-packages``). Where a
    GPU's host time per call differs from the CPU's stubbed figure, this says which step it is."""
    import cProfile
    import io
    import pstats

    cuda = torch.device(device).type == "cuda"
    for _ in range(5):
        fn()
    if cuda:
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if cuda:
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    lines = []
    for line in text.getvalue().splitlines():
        for marker in ("site-packages/", "ssa_flash/"):
            at = line.find(marker)
            if at > 0:
                start = line.rfind(" ", 0, at) + 1
                line = line[:start] + ("" if marker == "site-packages/" else "ssa_flash/") + line[at + len(marker):]
                break
        lines.append(line.rstrip())
    return "\n".join(x for x in lines if x.strip())


def _profiles(device, dtype, B, H, L, D, backends, quiet) -> dict:
    """:func:`profile_calls` of the plain softmax forward and forward + backward per backend."""
    out = {}
    for case in cases(device, dtype, B, H, L, D, backends, ("softmax",), ("plain",)):
        if case.impl == "sdpa":
            continue
        label = f"{case.impl} {case.op} {case.feature} {case.pass_}"
        try:
            out[label] = profile_calls(case.fn, device, calls=100 if case.pass_ == "fwd_bwd" else 200)
        except Exception as err:
            out[label] = f"{type(err).__name__}: {err}"[:200]
        if not quiet:
            print(f"\nprofile of {label} (cProfile, per {100 if case.pass_ == 'fwd_bwd' else 200} calls):\n"
                  f"{out[label]}", flush=True)
    return out


def _sdpa_key(case: Case) -> tuple:
    return ("plain" if case.feature not in ("mask", "dropout") else case.feature, case.pass_)


def run(out_dir: Optional[str] = None, reps: int = 100, backends=("triton", "cuda"), ops=OPS,
        features=FEATURES, passes=("fwd", "fwd_bwd"), quiet: bool = False, split: bool = True,
        profile: bool = False) -> dict:
    """Measures every case; returns the results and, when ``out_dir`` is given, writes them after
    every row (a run cut by a time limit keeps what it measured). ``profile``: first a cProfile of
    the plain softmax calls per backend (:func:`profile_calls`), under ``"profile"``."""
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float16  # float16: the CPU path then converts nothing
    B, H, L, D = (1, 2, 128, 64) if gpu else (1, 2, 64, 16)
    results = {"device": torch.cuda.get_device_name() if gpu else "cpu (launches stubbed)",
               "date": datetime.date.today().isoformat(), "torch": torch.__version__,
               "triton": _triton_version(), "shape": {"B": B, "H": H, "L": L, "D": D, "dtype": str(dtype)},
               "reps": reps, "rows": []}
    path = None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        name = results["device"].split(" (")[0].lower().replace(" ", "-")
        path = os.path.join(out_dir, f"{results['date']}-{name}-host.json")

    def save():
        if path:
            with open(path, "w") as f:
                json.dump(results, f, indent=1)

    with ExitStack() as stack:
        if not gpu:
            torch.set_num_threads(1)
            stack.enter_context(stubbed_launches())
        elif "cuda" in backends:
            import ssa_flash

            if "cuda" not in ssa_flash.available_backends("cuda"):
                backends = tuple(b for b in backends if b != "cuda")
        if profile:  # first: where the time goes decides more than the table below
            results["profile"] = _profiles(device, dtype, B, H, L, D, backends, quiet)
            save()
        rows, sdpa = results["rows"], {}
        for case in cases(device, dtype, B, H, L, D, backends, ops, features, passes):
            base_case = sdpa.get(_sdpa_key(case)) if case.impl != "sdpa" else None
            note, base = None, None
            try:
                if base_case is None:
                    us = host_time_us([case.fn], device, reps=reps)[0]
                else:  # measured beside its SDPA baseline, interleaved
                    us, base = host_time_us([case.fn, base_case.fn], device, reps=reps)
            except Exception as err:  # keep the row, say why
                us, note = None, f"{type(err).__name__}: {err}"[:200]
            row = {"op": case.op, "impl": case.impl, "feature": case.feature, "pass": case.pass_, "host_us": us,
                   "python_calls": None if note else python_calls(case.fn)}
            if case.impl == "sdpa":
                sdpa[(case.feature, case.pass_)] = case
            else:
                row["sdpa_host_us"] = base
                row["ratio_to_sdpa"] = None if (us is None or not base) else us / base
            if note:
                row["note"] = note
            rows.append(row)
            save()
            if not quiet:
                print(_line(row), flush=True)
        if gpu and split:
            results["split"] = _splits(backends, ops, quiet)
            save()
    if path:
        results["path"] = path
    return results


def _splits(backends, ops, quiet) -> list:
    """The profiler split at the targets' shape, L = 1k (B 16, H 16, D 128, bf16), causal."""
    out = []
    device, dtype = torch.device("cuda"), torch.bfloat16
    for case in cases(device, dtype, 16, 16, 1024, 128, backends, ops, ("plain",)):
        try:
            split = kernel_split_us(case.fn)
        except Exception as err:
            split = {"note": f"{type(err).__name__}: {err}"[:200]}
        row = {"op": case.op, "impl": case.impl, "pass": case.pass_, "B": 16, "H": 16, "L": 1024, "D": 128, **split}
        out.append(row)
        if not quiet and "e2e_us" in split:
            print(f"split {case.impl:16s} {case.op:13s} {case.pass_:8s} end-to-end {split['e2e_us']:9.1f} us  "
                  f"kernels {split['kernel_us']:9.1f} us  {'HOST-BOUND' if split['host_bound'] else ''}", flush=True)
    return out


def _triton_version() -> Optional[str]:
    try:
        import triton

        return triton.__version__
    except Exception:
        return None


def _line(row: dict) -> str:
    us = "-" if row["host_us"] is None else f"{row['host_us']:8.1f} us"
    ratio = row.get("ratio_to_sdpa")
    rtxt = "" if ratio is None else f"  {ratio:5.1f}x SDPA"
    calls = row.get("python_calls")
    ctxt = "" if calls is None else f"  {calls:4d} calls"
    return (f"{row['impl']:16s} {row['op']:13s} {row['feature']:8s} {row['pass']:8s} {us}{ctxt}{rtxt}"
            f"{'  ' + row['note'] if row.get('note') else ''}")


def render(results: dict) -> str:
    """A text table: one line per row."""
    lines = [f"host time per call, {results['device']}, torch {results['torch']}, triton {results['triton']}, "
             f"shape {results['shape']}"]
    lines += [_line(r) for r in results["rows"]]
    return "\n".join(lines)
