"""``python -m ssa_flash``: check the kernels against the reference here, then time them.

1. Self-check: each variant (every score function of ``ssa_flash.scores``, with and without the
   adaptive temperature: softmax, adaptive, SSA, SSA+adaptive, logit scale, logit scale+adaptive),
   forward and backward (q, k, v and the score function's parameters), on small inputs with masks, causality, ``Lq != Lk`` and GQA, on every kernel
   backend present. FlashAttention's rule: the error against a float64 reference must be at most
   twice the error of the naive reference run in the same dtype, plus a small floor.
   On CUDA: float16, bfloat16, float32. Without a GPU: the Triton kernels through Triton's CPU
   interpreter (``TRITON_INTERPRET=1``, set here before Triton is imported) in float32 and float64.
   Each backend is checked on what its ``supports()`` accepts; the rest is listed as skipped with
   its reason (the CUDA C++ backend takes float16 and bfloat16 only). A CUDA extension that is
   neither prebuilt nor loaded is JIT-built first, saying so and how long it took
   (``--no-build-cuda``: skip the CUDA backend instead); a build that fails leaves the CUDA
   backend unchecked, reported as such, without failing the run (``backend="auto"`` never uses
   an unbuilt extension).
2. A small timing table reusing ``ssa_flash.bench`` (CUDA: our kernels vs SDPA's flash backend,
   median ms; CPU: tiny sizes through the interpreter, which measures the interpreter, not kernels).

What a first run costs on a GPU (a cold cache; later runs take seconds): the CUDA extension's JIT
build for this GPU's architecture only (an sm_90a build took 150-195 s on an H200's host; a
``TORCH_CUDA_ARCH_LIST`` naming other architectures too is narrowed to this GPU's for the build,
saying so), then the Triton kernels' compilation, a few seconds per specialisation: the checks
are shared out over ``--jobs`` processes (default: up to 8 on a GPU), each group of checks
(backend, dtype, variant) compiling its own specialisations once, so that the whole self-check
finishes in about two minutes. ``--backends cuda`` checks one backend only.

Exit status 0 when every check run passes, 1 otherwise. ``--help`` for options.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from .scores import SCORES as _SCORES
from .scores import VARIANTS as _VARIANTS

VARIANTS = tuple(_VARIANTS)
FLOORS = {"float64": 1e-9, "float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    hq: int
    hkv: int
    lq: int
    lk: int
    d: int
    causal: bool = False
    mask: Optional[str] = None  # None, "bool" (with one fully masked row) or "float" (with -inf)


CASES = (
    Case("plain", 1, 2, 2, 33, 33, 32),
    Case("causal Lq<Lk", 2, 2, 2, 17, 29, 24, causal=True),
    Case("GQA+bool mask", 1, 4, 2, 18, 18, 16, mask="bool"),
    Case("causal+float mask", 1, 2, 2, 20, 20, 16, causal=True, mask="float"),
)


def _setup_device(force_cpu: bool):
    """Chooses the device; without a GPU switches on Triton's interpreter before Triton is imported."""
    import torch

    if torch.cuda.is_available() and not force_cpu:
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        if "triton" in sys.modules:
            print("warning: triton was imported before TRITON_INTERPRET=1 could be set; "
                  "the Triton kernels may not run on the CPU", file=sys.stderr)
        os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)  # tiny CPU ops: waiting OpenMP threads cost more than they give
    return torch.device("cpu")


# ------------------------------------------------------------------------------------ self-check


def make_case_inputs(case: Case, device, seed: int = 0) -> Dict[str, object]:
    """float64 inputs on ``device``: q, k, v, dout, every score function's parameters by name
    (``(Hq,)``, the registry's example value times [0.5, 1.5]), and the mask (or None)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    t = {
        "q": torch.randn(case.batch, case.hq, case.lq, case.d, generator=g, dtype=f64),
        "k": torch.randn(case.batch, case.hkv, case.lk, case.d, generator=g, dtype=f64),
        "v": torch.randn(case.batch, case.hkv, case.lk, case.d, generator=g, dtype=f64),
        "dout": torch.randn(case.batch, case.hq, case.lq, case.d, generator=g, dtype=f64),
        "mask": None,
    }
    for score in _SCORES.values():
        for name, example in zip(score.params, score.example):
            t[name] = example * (0.5 + torch.rand(case.hq, generator=g, dtype=f64))
    if case.mask == "bool":
        m = torch.rand(case.batch, 1, case.lq, case.lk, generator=g) > 0.3
        m[..., 3, :] = False  # a row that can attend to nothing: output 0, gradients 0
        t["mask"] = m
    elif case.mask == "float":
        m = torch.randn(case.batch, case.hq, case.lq, case.lk, generator=g, dtype=f64)
        m[torch.rand(m.shape, generator=g) < 0.2] = float("-inf")
        t["mask"] = m
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in t.items()}


def call_variant(variant: str, backend: str, q, k, v, params, mask, case: Case):
    """A variant through the public API with ``backend``; ``params`` the score function's
    parameters in the registry's order. ``backend="spec"``: ``ssa_flash.reference``, the
    specification computed in the inputs' dtype (the naive implementation of FlashAttention's
    rule; ``backend="reference"`` accumulates in float32)."""
    import ssa_flash
    from ssa_flash import reference

    v_ = _VARIANTS[variant]
    kw = dict(attn_mask=mask, is_causal=case.causal, enable_gqa=case.hq != case.hkv)
    if backend == "spec":
        fn = reference.attention
    else:
        fn, kw["backend"] = ssa_flash.attention, backend
    return fn(q, k, v, score=v_.score.name, score_params=tuple(params), adaptive_temperature=v_.adaptive, **kw)


def _run(fn: Callable, variant: str, inputs: Dict[str, object], dtype, case: Case):
    """Output and gradients of ``fn(q, k, v, params, mask)`` with inputs cast to ``dtype``."""
    import torch

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (inputs[x].detach().to(dtype).requires_grad_() for x in "qkv")
    names = _VARIANTS[variant].score.params
    params = tuple(inputs[nm].detach().to(acc).requires_grad_() for nm in names)
    mask = inputs["mask"]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    out = fn(q, k, v, params, mask)
    wrt = [q, k, v, *params]
    grads = torch.autograd.grad(out, wrt, inputs["dout"].to(out.dtype))
    names = ["dq", "dk", "dv"] + [f"d{nm}" for nm in names]
    res = {"out": out.detach()}
    res.update({nm: gr.detach() for nm, gr in zip(names, grads)})
    return res


@dataclass
class CheckResult:
    backend: str
    dtype: str
    variant: str
    case: str
    ok: bool
    worst: str  # "tensor: err / tol"
    detail: str = ""
    skipped: bool = False  # not run: the backend's supports() refuses these inputs (detail says why)


def check(variant: str, case: Case, dtype, device, backend: str,
          fn: Optional[Callable] = None, seed: int = 0) -> CheckResult:
    """One self-check. ``fn(q, k, v, params, mask)`` overrides the backend call (the tests use it to
    show that a wrong implementation is caught)."""
    import torch

    dname = str(dtype).replace("torch.", "")
    inputs = make_case_inputs(case, device, seed)
    if fn is None:
        def fn(q, k, v, params, mask):
            return call_variant(variant, backend, q, k, v, params, mask, case)

    def ref(q, k, v, params, mask):
        return call_variant(variant, "spec", q, k, v, params, mask, case)

    try:
        gold = _run(ref, variant, inputs, torch.float64, case)
        naive = _run(ref, variant, inputs, dtype, case)
        ours = _run(fn, variant, inputs, dtype, case)
    except Exception as err:
        msg = " ".join(str(err).split())[:200]
        return CheckResult(backend, dname, variant, case.name, False, "error", f"{type(err).__name__}: {msg}")
    ok, worst_ratio, worst = True, -1.0, ""
    for name, g in gold.items():
        g = g.double()
        err = (ours[name].double() - g).abs().max().item()
        nerr = (naive[name].double() - g).abs().max().item()
        tol = 2.0 * nerr + FLOORS[dname] * max(1.0, g.abs().max().item())
        ratio = err / tol if err == err else float("inf")  # NaN fails
        if not ratio <= 1.0:
            ok = False
        if ratio > worst_ratio:
            worst_ratio, worst = ratio, f"{name}: {err:.2e} / {tol:.2e}"
    return CheckResult(backend, dname, variant, case.name, ok, worst)


def support_reason(backend: str, variant: str, case: Case, dtype, device) -> Optional[str]:
    """Why ``backend`` does not run ``variant`` on ``case``'s inputs in ``dtype`` (its
    ``supports()`` on the same tensors the check would use), or None."""
    from .backends import AttentionSpec, get

    if backend == "reference":
        return None
    t = make_case_inputs(case, device)
    q, k, v = (t[x].to(dtype) for x in "qkv")
    spec = AttentionSpec(scale=case.d ** -0.5, score=_VARIANTS[variant].score.name, causal=case.causal,
                         group=case.hq // case.hkv, adaptive=_VARIANTS[variant].adaptive)
    try:
        return get(backend).supports(q, k, v, spec)
    except Exception:  # a probe that raises is a finding, not a skip: the check runs and reports it
        return None


def _line(r: CheckResult) -> str:
    status = "skipped" if r.skipped else "ok" if r.ok else "FAIL"
    return (f"{r.backend:8s} {r.dtype:9s} {r.variant:13s} {r.case:19s} {r.worst:34s} "
            f"{status}{'  ' + r.detail if r.detail else ''}")


@contextlib.contextmanager
def first_block_configuration():
    """The checks compile each Triton specialisation once, with the launcher's first block
    configuration that fits, instead of compiling and timing every candidate: they check
    correctness, not speed (the test suite checks every configuration). On an H200 the timed
    choice made the first run spend ~6 s per kernel tuning inputs of a few hundred elements.
    A user's own ``SSA_FLASH_AUTOTUNE`` is left as it is."""
    if "SSA_FLASH_AUTOTUNE" in os.environ:
        yield
        return
    os.environ["SSA_FLASH_AUTOTUNE"] = "0"
    try:
        yield
    finally:
        os.environ.pop("SSA_FLASH_AUTOTUNE", None)


def _check_group(device: str, backend: str, dname: str, variant: str,
                 reasons: Dict[str, Optional[str]]) -> List[CheckResult]:
    """One (backend, dtype, variant)'s checks over every case, in a worker process of
    :func:`self_check` (the kernels it compiles are its own specialisations)."""
    import torch

    dtype = getattr(torch, dname)
    device = torch.device(device)
    out = []
    with first_block_configuration():
        for case in CASES:
            reason = reasons.get(case.name)
            if reason is not None:
                out.append(CheckResult(backend, dname, variant, case.name, True, "-", reason, skipped=True))
            else:
                out.append(check(variant, case, dtype, device, backend))
    return out


def default_jobs(device) -> int:
    """Worker processes of the checks: on a GPU up to 8 (each compiles its own kernels: Triton's
    compiler runs on one CPU core a process), never more than the CPU cores; 1 on the CPU."""
    if device.type != "cuda":
        return 1
    return max(1, min(8, os.cpu_count() or 1))


def self_check(device, backends: List[str], dtypes, stream=None, jobs: int = 1) -> List[CheckResult]:
    """Every (backend, dtype, case, variant) check; the ones the backend's ``supports()`` refuses
    are skipped results (one line for a dtype refused everywhere, with the reason). With
    ``jobs`` > 1 the (backend, dtype, variant) groups run in that many worker
    processes, their lines printed as each group finishes."""
    stream = stream or sys.stdout
    results = []
    groups = []
    header = f"{'backend':8s} {'dtype':9s} {'variant':13s} {'case':19s} {'worst: error / tolerance':34s} result"
    print(header, file=stream)
    print("-" * len(header), file=stream)
    for backend in backends:
        for dtype in dtypes:
            dname = str(dtype).replace("torch.", "")
            why = {(case, variant): support_reason(backend, variant, case, dtype, device)
                   for case in CASES for variant in VARIANTS}
            reasons = set(why.values())
            if None not in reasons and len(reasons) == 1:  # the whole dtype refused, one reason
                reason = reasons.pop()
                results.extend(CheckResult(backend, dname, variant, case.name, True, "-", reason, skipped=True)
                               for case in CASES for variant in VARIANTS)
                print(f"{backend:8s} {dname:9s} {'(all)':13s} {'(all)':19s} {'-':34s} skipped  {reason}",
                      file=stream, flush=True)
                continue
            if jobs > 1:
                groups += [(device.type, backend, dname, variant, {case.name: why[(case, variant)] for case in CASES})
                           for variant in VARIANTS]
                continue
            for case in CASES:
                for variant in VARIANTS:
                    reason = why[(case, variant)]
                    if reason is not None:
                        r = CheckResult(backend, dname, variant, case.name, True, "-", reason, skipped=True)
                    else:
                        r = check(variant, case, dtype, device, backend)
                    results.append(r)
                    print(_line(r), file=stream, flush=True)
    if groups:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(min(jobs, len(groups)), mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_check_group, *g): g for g in groups}
            for fut in as_completed(futures):
                _, backend, dname, variant, _ = futures[fut]
                try:
                    rs = fut.result()
                except Exception as err:  # a worker that died (a CUDA error): its checks fail
                    msg = " ".join(str(err).split())[:200]
                    rs = [CheckResult(backend, dname, variant, case.name, False, "error",
                                      f"worker: {type(err).__name__}: {msg}") for case in CASES]
                for r in rs:
                    results.append(r)
                    print(_line(r), file=stream, flush=True)
    return results


def prepare_cuda(build: bool, stream=None) -> Optional[str]:
    """Makes the CUDA extension usable before the checks: builds it (JIT, minutes on first use)
    unless it is prebuilt or loaded, saying so and how long it took. Returns why the CUDA backend
    is not checked (``build`` false and nothing built, the build failed, or a prebuilt extension
    does not import), or None."""
    from .backends import cuda_backend
    from .errors import BackendUnavailableError

    stream = stream or sys.stdout
    if cuda_backend.ready():  # loaded, or prebuilt: importing it is quick (and may fail: ABI)
        try:
            cuda_backend.load_extension()
        except BackendUnavailableError as err:
            return f"{err}"
        return None
    if not build:
        return "the CUDA extension is not built (--no-build-cuda)"
    archs = pin_arch_list(stream)
    print(f"building the CUDA extension (first use, may take minutes{f' for {archs}' if archs else ''}; "
          "--no-build-cuda skips it; cached by torch afterwards)...", file=stream, flush=True)
    t0 = time.monotonic()
    try:
        cuda_backend.load_extension()
    except BackendUnavailableError as err:
        print(f"the CUDA extension build failed after {time.monotonic() - t0:.0f} s", file=stream, flush=True)
        return f"{err}"
    print(f"built the CUDA extension in {time.monotonic() - t0:.0f} s\n", file=stream, flush=True)
    return None


def pin_arch_list(stream=None) -> Optional[str]:
    """Before a JIT build: ``TORCH_CUDA_ARCH_LIST`` set to the visible GPUs' architectures only
    (sm_90 as 9.0a), saying so when it replaces a longer list (each architecture more is one more
    full build of every kernel instance). Returns the list, or None without a GPU."""
    import torch

    from .backends import _cuda_build

    if not torch.cuda.is_available():
        return None
    archs = _cuda_build.device_arch_list(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))
    given = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if given and _cuda_build.normalize_arch_list(given)[0] != archs:
        print(f"TORCH_CUDA_ARCH_LIST={given!r} narrowed to {archs!r} for this build (the GPUs here; "
              f"{_cuda_build.arch_count(given)} architectures would take as many times longer)",
              file=stream or sys.stdout, flush=True)
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    return archs


# ------------------------------------------------------------------------------------ timing


def timing_table(device, backends: List[str], stream=None) -> None:
    """Median ms of forward and forward+backward, ours vs SDPA's flash backend (softmax)."""
    stream = stream or sys.stdout
    import torch

    from .bench import impls, timing

    if device.type == "cuda":
        shapes = [impls.Shape(4, 16, 2048, 128, causal, torch.bfloat16) for causal in (False, True)]
        kw = dict(warmup_ms=25, rep_ms=100)
        note = f"CUDA ({torch.cuda.get_device_name(device)}), median of CUDA-event timings after warm-up"
    else:
        shapes = [impls.Shape(1, 2, 32, 32, False, torch.float32)]
        kw = dict(cpu_reps=1, cpu_warmup=1)
        note = ("CPU through the Triton interpreter: tiny sizes; these times measure the interpreter "
                "and say nothing about GPU speed")
    print(f"\nTiming: {note}", file=stream)
    ours = [f"ssa_flash.{b}" for b in backends]
    rows = [(op, impl) for impl in ours for op in impls.OPS] + [("softmax", "sdpa.flash")]
    header = (f"{'shape':36s} {'op':13s} {'impl':17s} {'fwd ms':>10s} {'fwd+bwd ms':>11s} "
              f"{'SDPA/ours fwd':>13s} {'SDPA/ours f+b':>13s}")
    print(header, file=stream)
    print("-" * len(header), file=stream)
    for shape in shapes:
        inputs = impls.make_inputs(shape, device)
        times = {}
        for op, impl in [rows[-1]] + rows[:-1]:  # SDPA first: the baseline of the ratio columns
            res = {}
            for p in ("fwd", "fwd_bwd"):
                try:
                    call = impls.build_call(op, impl, shape, inputs, device)
                    with call.context():
                        fn, cleanup = impls.pass_fn(call, p, inputs.dout)
                        res[p] = timing.time_ms(fn, device, **kw)
                        cleanup()
                except Exception as err:
                    res[p] = None
                    res["note"] = "out of memory" if timing.is_oom(err) else f"{type(err).__name__}: {str(err)[:60]}"
                timing.free_memory(device)
            times[(op, impl)] = res
        base = times[("softmax", "sdpa.flash")]
        for op, impl in rows:
            res = times[(op, impl)]

            def f(x):
                return f"{x:10.3f}" if x is not None else f"{'-':>10s}"

            def ratio(p):
                if res.get(p) and base.get(p):
                    return f"{base[p] / res[p]:13.3g}"
                return f"{'-':>13s}"

            print(f"{shape.describe():36s} {op:13s} {impl:17s} {f(res.get('fwd'))} {f(res.get('fwd_bwd')):>11s} "
                  f"{ratio('fwd')} {ratio('fwd_bwd')}{'  ' + res['note'] if res.get('note') else ''}",
                  file=stream, flush=True)
    print("SDPA/ours: SDPA's flash backend doing softmax, divided by ours (above 1: ours is faster). "
          "Full benchmark: python -m ssa_flash.bench", file=stream)


# ------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssa_flash", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="check on the CPU through the Triton interpreter even with a GPU")
    p.add_argument("--no-timing", action="store_true", help="skip the timing table")
    p.add_argument("--no-build-cuda", action="store_true",
                   help="do not JIT-build the CUDA extension when it is not built yet (minutes); the "
                        "CUDA backend is then not checked")
    p.add_argument("--backends", default=None,
                   help="comma list of the kernel backends to check (triton, cuda); default: every one here")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes for the checks on a GPU (default: up to 8; 1 runs them in this process)")
    args = p.parse_args(argv)

    t0 = time.monotonic()
    device = _setup_device(args.cpu)
    import torch

    import ssa_flash

    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = "not installed"
    # the CUDA C++ backend first: its checks need no Triton compiles, and it is the one least often
    # run on a GPU
    backends = sorted((b for b in ssa_flash.available_backends(device) if b != "reference"), key=lambda b: b != "cuda")
    if args.backends:
        wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
        missing = [b for b in wanted if b not in backends]
        if missing:
            print(f"FAILED: backend(s) {', '.join(missing)} not available here (available: "
                  f"{', '.join(backends) or 'none'})")
            return 1
        backends = wanted
    if device.type == "cuda":
        dtypes = [torch.float16, torch.bfloat16, torch.float32]
        where = f"CUDA: {torch.cuda.get_device_name(device)}"
    else:
        dtypes = [torch.float32, torch.float64]
        where = "CPU, Triton interpreter (no GPU: small sizes)"
    print(f"ssa_flash {ssa_flash.__version__} self-check on {where}")
    print(f"torch {torch.__version__}, triton {triton_version}, CUDA {torch.version.cuda}; "
          f"kernel backends here: {', '.join(backends) or 'none'}")
    if device.type == "cuda":
        print("first run on this machine (cold caches): the CUDA extension's build for this GPU only "
              "(~2.5-3 min for sm_90a), then ~1-2 min of Triton compiles; later runs: seconds")
    not_checked = {}
    if "cuda" in backends:
        why = prepare_cuda(not args.no_build_cuda)
        if why is None:  # built: the extension may still lack this GPU's kernels
            from .backends import cuda_backend

            why = cuda_backend.unavailable_reason(device)
        if why is not None:
            not_checked["cuda"] = why
            backends.remove("cuda")
            print(f"not checked: backend 'cuda': {why}")
    if not backends:
        print("FAILED: no kernel backend can run here (install triton; on the CPU it runs through "
              "TRITON_INTERPRET=1), so nothing was checked")
        return 1
    print("rule: max|ours - float64 reference| <= 2 * max|naive reference in the same dtype - float64 "
          "reference| + floor * max(1, max|float64 reference|), for out, dq, dk, dv (db, dn for SSA); "
          f"floors {', '.join(f'{k} {v:g}' for k, v in FLOORS.items() if k in [str(d).replace('torch.', '') for d in dtypes])}\n")
    jobs = args.jobs if args.jobs is not None else default_jobs(device)
    if device.type == "cuda":  # an H200 took ~5 s a check on a cold cache: minutes in all
        print(f"(each check compiles the kernels it runs the first time on this machine, a few seconds "
              f"each, shared out over {jobs} process{'es' if jobs > 1 else ''}; Triton caches them in "
              "~/.triton/cache, so later runs start at once)\n", flush=True)
    with first_block_configuration():
        results = self_check(device, backends, dtypes, jobs=jobs)
    failed = [r for r in results if not r.ok]
    skipped = [r for r in results if r.skipped]
    run = len(results) - len(skipped)
    print(f"\n{run - len(failed)} of {run} checks passed ({time.monotonic() - t0:.1f} s)"
          + ("" if not skipped else f"; {len(skipped)} skipped (inputs the backend does not take)")
          + ("" if not failed else f"; {len(failed)} FAILED"))
    if not args.no_timing:
        try:
            timing_table(device, backends)
        except Exception as err:  # timing is informative; the exit status reflects the checks
            print(f"timing table failed: {type(err).__name__}: {err}")
    unchecked = "".join(f"; backend {name!r} not checked: {why}" for name, why in not_checked.items())
    print(f"\n{'FAILED' if failed else 'OK'} ({time.monotonic() - t0:.1f} s){unchecked}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
