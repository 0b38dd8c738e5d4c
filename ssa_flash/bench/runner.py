"""The benchmark loop: plan the rows, measure each (an out-of-memory or unsupported row is
recorded with ``"ms": null`` and a note, never a crash), show progress, write the results file.

Rows are measured in phases so that a time budget cuts the least important ones:
matmul rate; speed sweep of our backends and ``sdpa.flash``; the memory sweep; ``flex`` (one
compilation per shape); the other SDPA backends and the naive reference; softmax with a learned
(H, L, L) bias (GPU only: ours beside ``sdpa.efficient``). Rows the budget cuts are
kept with a note.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from . import timing
from .impls import (IMPL_OPS, IMPLS, LEARNED_BIAS_IMPLS, LEARNED_BIAS_OP, OPS, PASSES, NotRunnable, Shape,
                    availability, build_call, dtype_name, make_inputs, pass_fn)

# measured first, side by side: ours and what users would pick instead, SDPA's flash backend
# (FlashAttention-2) and its cuDNN backend (torch's default on Hopper with a recent cuDNN).
# FlashAttention-4's Hopper kernels are not a row: their wheels with the CuTe DSL libraries are
# ~200 MB, too large for a GPU session's 64 MiB carry; its published figures are the anchor.
CORE_IMPLS = ("ssa_flash.triton", "ssa_flash.cuda", "sdpa.flash", "sdpa.cudnn")
# --subset: named row sets. "targets": the rows docs/design.md §4.1's targets are judged on (H100
# bf16, 16k tokens, 16 heads, D 64 / 128, L 1k-16k, causal and not; SSA and adaptive vs our softmax
# and SDPA, FlexAttention's SSA; the 128k memory row), nothing else.
SUBSETS = {
    "targets": dict(ops=("softmax", "ssa", "adaptive"),
                    impls=("ssa_flash.triton", "ssa_flash.cuda", "sdpa.flash", "sdpa.cudnn", "flex"),
                    passes=("fwd", "fwd_bwd"), headdims=(64, 128), seqlens=(1024, 2048, 4096, 8192, 16384),
                    causal=(False, True), memory_seqlens=(131072,),
                    memory_impls=("ssa_flash.triton", "ssa_flash.cuda"), memory_ops=("ssa",)),
}
ROW_FIELDS = ("op", "impl", "pass", "dtype", "batch", "heads", "seqlen", "headdim", "causal", "ms",
              "tflops", "peak_mem_bytes")


@dataclass
class Config:
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    seqlens: Sequence[int] = (1024, 2048, 4096, 8192, 16384)
    headdims: Sequence[int] = (64, 128)
    batch_tokens: int = 16384
    heads: int = 16
    causal: Sequence[bool] = (False, True)
    ops: Sequence[str] = OPS
    impls: Sequence[str] = IMPLS
    passes: Sequence[str] = PASSES
    # memory sweep (forward+backward, docs/design.md §4.1: B=1, H=16, D=128 up to 128k); empty disables it
    memory_seqlens: Sequence[int] = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
    memory_impls: Sequence[str] = ("ssa_flash.triton", "ssa_flash.cuda", "sdpa.flash", "reference")
    memory_ops: Sequence[str] = OPS
    memory_heads: int = 16
    memory_headdim: int = 128
    memory_causal: bool = True
    memory_reps: int = 2
    matmul_size: int = 8192
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    cpu_reps: int = 3
    cpu_warmup: int = 1
    time_budget_s: Optional[float] = None
    # the phases of plan(), in the order they run; a phase left out does not run (--phases)
    phases: Sequence[str] = ("speed", "memory", "learned_bias", "flex", "others")
    smoke: bool = False
    gpu_tests: Optional[Dict[str, int]] = None
    quiet: bool = False


def apply_subset(cfg: "Config", name: str) -> "Config":
    """``cfg`` narrowed to the row set ``name`` of :data:`SUBSETS` (in place; returned). The CPU
    smoke mode keeps its tiny shapes and implementations: only the operations and passes narrow."""
    for key, value in SUBSETS[name].items():
        if not cfg.smoke or key in ("ops", "passes"):
            setattr(cfg, key, value)
    return cfg


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _versions() -> Dict[str, Optional[str]]:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda}


def _git_commit() -> Optional[str]:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except Exception:
        return None


@dataclass
class Task:
    sweep: str  # "speed" or "memory"
    shape: Shape
    op: str
    impl: str
    passes: Sequence[str]


def speed_shapes(cfg: Config) -> List[Shape]:
    shapes = []
    for d in cfg.headdims:
        for causal in cfg.causal:
            for L in cfg.seqlens:
                shapes.append(Shape(max(1, cfg.batch_tokens // L), cfg.heads, L, d, causal, cfg.dtype))
    return shapes


def plan(cfg: Config) -> List[Task]:
    """Every row group to measure, most important first (``cfg.phases``: which phases, in
    which order)."""
    impls = [i for i in IMPLS if i in cfg.impls]
    core = [i for i in impls if i in CORE_IMPLS]
    rest = [i for i in impls if i not in CORE_IMPLS and i != "flex"]
    tasks: List[Task] = []

    def speed(group, shapes):
        for shape in shapes:
            for op in cfg.ops:
                for impl in group:
                    if op in IMPL_OPS[impl]:
                        tasks.append(Task("speed", shape, op, impl, tuple(cfg.passes)))

    shapes = speed_shapes(cfg)

    def memory():
        for L in cfg.memory_seqlens:
            shape = Shape(1, cfg.memory_heads, L, cfg.memory_headdim, cfg.memory_causal, cfg.dtype)
            for op in [o for o in OPS if o in cfg.memory_ops]:
                for impl in [i for i in IMPLS if i in cfg.memory_impls]:
                    if op in IMPL_OPS[impl]:
                        tasks.append(Task("memory", shape, op, impl, ("fwd_bwd",)))

    def learned_bias(shapes):
        # forward + backward with a learned (H, L, L) bias (impls.LEARNED_BIAS_OP); GPU only
        if not str(cfg.device).startswith("cuda"):
            return
        # SDPA's efficient backend comes with our rows whatever --impls says: the target is a ratio
        # to it, taken side by side (docs/design.md section 4.1)
        ours = [i for i in LEARNED_BIAS_IMPLS if i in impls and not i.startswith("sdpa.")]
        chosen = [i for i in LEARNED_BIAS_IMPLS if i in ours or (ours and i.startswith("sdpa."))]
        for shape in shapes:
            for impl in chosen:
                tasks.append(Task("speed", shape, LEARNED_BIAS_OP, impl, ("fwd_bwd",)))

    phases = {
        "speed": lambda: speed(core, shapes),  # ours and sdpa.flash
        "memory": memory,
        # flex compiles once per shape (static shapes, its best case): longest lengths first, every
        # (head dim, causality) panel at each length, so that a time budget cuts the short lengths
        "flex": lambda: speed([i for i in impls if i == "flex"], sorted(shapes, key=lambda s: -s.seqlen)),
        "others": lambda: speed(rest, shapes),  # the other SDPA backends, the reference
        "learned_bias": lambda: learned_bias(shapes),
    }
    for name in cfg.phases:
        phases[name]()
    return tasks


def _sig(x: float, digits: int = 6) -> float:
    """``x`` rounded to ``digits`` significant digits (keeps tiny CPU figures non-zero)."""
    return float(f"{float(x):.{digits}g}")


def _short(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}"


class Runner:
    def __init__(self, cfg: Config, out_path: Optional[str] = None, stream=sys.stderr):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.out_path = out_path
        self.stream = stream
        self.rows: List[dict] = []
        self.start = time.monotonic()
        self.results: dict = {}
        self._unavailable: Dict[str, Optional[str]] = {}
        self._warmed: set = set()
        self._sweep_seconds: Dict[tuple, tuple] = {}  # (op, impl) -> (seqlen, seconds) of the memory sweep

    def expected_seconds(self, task: Task) -> Optional[float]:
        """A memory-sweep row's expected wall time: the same (op, impl) at the previous length,
        scaled by the square of the length ratio (attention's cost; tuning and compiling
        included). None for the first length and for speed rows."""
        prev = self._sweep_seconds.get((task.op, task.impl)) if task.sweep == "memory" else None
        if prev is None:
            return None
        seqlen, seconds = prev
        return seconds * (task.shape.seqlen / seqlen) ** 2

    def would_overrun(self, task: Task) -> Optional[float]:
        """The expected seconds of ``task`` when starting it now would end past the time budget
        (a 128k row started just inside the budget ran on past the caller's hard limit), else None."""
        expected = self.expected_seconds(task)
        if self.cfg.time_budget_s is None or expected is None:
            return None
        return expected if self.elapsed() + expected > self.cfg.time_budget_s else None

    # ---------------------------------------------------------------- progress and output
    def log(self, msg: str) -> None:
        if not self.cfg.quiet:
            print(msg, file=self.stream, flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def over_budget(self) -> bool:
        return self.cfg.time_budget_s is not None and self.elapsed() > self.cfg.time_budget_s

    def save(self) -> None:
        if not self.out_path:
            return
        self.results["rows"] = self.rows
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=1)
        os.replace(tmp, self.out_path)

    # ---------------------------------------------------------------- measurement
    def _row(self, task: Task, pass_: str) -> dict:
        s = task.shape
        return {"op": task.op, "impl": task.impl, "pass": pass_, "dtype": dtype_name(s.dtype),
                "batch": s.batch, "heads": s.heads, "seqlen": s.seqlen, "headdim": s.headdim,
                "causal": s.causal, "ms": None, "tflops": None, "peak_mem_bytes": None,
                "matmul_fraction": None, "io_bytes": s.io_bytes(), "sweep": task.sweep}

    def _finish(self, row: dict, ms: Optional[float], peak: Optional[int], note: Optional[str]) -> dict:
        s = row
        row["ms"] = None if ms is None else _sig(ms)
        if ms is not None and ms > 0:
            fl = timing.attention_flops(s["batch"], s["heads"], s["seqlen"], s["seqlen"], s["headdim"],
                                        s["causal"], s["pass"])
            tf = timing.tflops(fl, ms)
            row["tflops"] = _sig(tf)
            mm = self.results.get("matmul_tflops")
            if mm:
                row["matmul_fraction"] = _sig(tf / mm)
        row["peak_mem_bytes"] = peak
        if note:
            row["note"] = note
        return row

    def _measure_pass(self, call, pass_: str, dout, sweep: str):
        fn, cleanup = pass_fn(call, pass_, dout)
        try:
            peak = timing.peak_memory_bytes(fn, self.device)  # first call: also compiles / warms up
            if sweep == "memory":
                ms = timing.time_ms_few(fn, self.device, reps=self.cfg.memory_reps)
            else:
                ms = timing.time_ms(fn, self.device, warmup_ms=self.cfg.warmup_ms,
                                    rep_ms=self.cfg.rep_ms, cpu_reps=self.cfg.cpu_reps,
                                    cpu_warmup=self.cfg.cpu_warmup)
        finally:
            cleanup()
            del fn
        return ms, peak

    def _note_for(self, err: BaseException, pass_: str) -> str:
        if timing.is_oom(err):
            return "out of memory"
        text = str(err)
        if any(t in text for t in ("No available kernel", "No viable backend", "not supported")):
            return "unsupported: " + _short(err)
        return "error: " + _short(err)

    def run_task(self, task: Task, inputs) -> List[dict]:
        rows = {p: self._row(task, p) for p in task.passes}
        if self.over_budget():
            return [self._finish(r, None, None, "skipped: time budget exhausted") for r in rows.values()]
        expected = self.would_overrun(task)
        if expected is not None:
            note = f"skipped: would overrun the time budget (~{expected:.0f} s expected from the previous length)"
            return [self._finish(r, None, None, note) for r in rows.values()]
        if task.impl not in self._unavailable:
            self._unavailable[task.impl] = availability(task.impl, self.device)
        why = self._unavailable[task.impl]
        if why is not None:
            return [self._finish(r, None, None, why) for r in rows.values()]
        measured: Dict[str, tuple] = {}
        order = [p for p in ("fwd", "fwd_bwd", "bwd") if p in rows]
        call = None
        try:
            call = build_call(task.op, task.impl, task.shape, inputs, self.device)
        except NotRunnable as err:
            return [self._finish(r, None, None, str(err)) for r in rows.values()]
        except Exception as err:
            note = self._note_for(err, "build")
            timing.free_memory(self.device)
            return [self._finish(r, None, None, note) for r in rows.values()]
        if self.device.type == "cpu" and self.cfg.cpu_warmup == 0 and (task.impl, task.op) not in self._warmed:
            # one untimed forward+backward per (impl, op): the first call pays for lazy imports
            self._warmed.add((task.impl, task.op))
            try:
                with call.context(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    pass_fn(call, "fwd_bwd", inputs.dout)[0]()
            except Exception:
                pass  # the measured calls below record the error
        for p in order:
            note = None
            ms = peak = None
            try:
                with call.context(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ms, peak = self._measure_pass(call, p, inputs.dout, task.sweep)
            except Exception as err:
                note = self._note_for(err, p)
            timing.free_memory(self.device)
            if (ms is None and p == "bwd" and not (note or "").startswith("out of memory")
                    and measured.get("fwd", (None,))[0] is not None
                    and measured.get("fwd_bwd", (None,))[0] is not None):
                ms = max(measured["fwd_bwd"][0] - measured["fwd"][0], 1e-6)
                note = f"derived as fwd_bwd - fwd; backward alone failed ({note})"
            measured[p] = (ms, peak, note)
        del call
        timing.free_memory(self.device)
        return [self._finish(rows[p], *measured[p]) for p in task.passes]

    def _progress(self, done: int, total: int, row: dict) -> None:
        t = self.elapsed()
        head = f"[{done:4d}/{total} {int(t // 60):3d}m{int(t % 60):02d}s]"
        what = (f"{row['sweep']:6s} {row['op']:12s} {row['impl']:16s} {row['pass']:7s} "
                f"{row['dtype']} B={row['batch']} H={row['heads']} L={row['seqlen']} "
                f"D={row['headdim']}{' causal' if row['causal'] else ''}")
        if row["ms"] is not None:
            res = f"{row['ms']:10.4f} ms"
            if row["tflops"] is not None:
                res += f" {row['tflops']:8.3g} TFLOP/s"
            if row["peak_mem_bytes"] is not None:
                res += f" peak {row['peak_mem_bytes'] / 2**30:.2f} GiB"
            if row.get("note"):
                res += f"  ({row['note']})"
        else:
            res = f"-- {row.get('note', '')}"
        self.log(f"{head} {what}: {res}")

    # ---------------------------------------------------------------- the run
    def run(self) -> dict:
        cfg = self.cfg
        dev = self.device
        device_name = device_label(dev)
        import ssa_flash

        vers = _versions()
        self.results = {
            "device": device_name,
            "date": datetime.date.today().isoformat(),
            "torch": vers["torch"], "triton": vers["triton"], "cuda": vers["cuda"],
            "matmul_tflops": None,
            "gpu_tests": cfg.gpu_tests if cfg.gpu_tests is not None else
            {"passed": None, "failed": None, "skipped": None},
            "rows": self.rows,
            "ssa_flash": ssa_flash.__version__,
            "git_commit": _git_commit(),
            "python": platform.python_version(),
            "smoke": cfg.smoke,
            "config": {k: (dtype_name(v) if isinstance(v, torch.dtype) else v)
                       for k, v in asdict(cfg).items() if k not in ("gpu_tests", "quiet")},
        }
        self.log(f"ssa_flash benchmark on {device_name}: torch {vers['torch']}, triton {vers['triton']}, "
                 f"cuda {vers['cuda']}")
        try:
            mm = timing.matmul_tflops(dev, cfg.dtype, cfg.matmul_size, warmup_ms=cfg.warmup_ms,
                                      rep_ms=cfg.rep_ms)
            self.results["matmul_tflops"] = None if mm is None else _sig(mm)
            self.log(f"dense {dtype_name(cfg.dtype)} matmul {cfg.matmul_size}^3: {mm:.4g} TFLOP/s")
        except Exception as err:
            self.results["matmul_note"] = "error: " + _short(err)
            self.log(f"matmul rate not measured: {_short(err)}")
            timing.free_memory(dev)
        self.results["matmul"] = {"size": cfg.matmul_size, "dtype": dtype_name(cfg.dtype)}
        tasks = plan(cfg)
        total = sum(len(t.passes) for t in tasks)
        self.log(f"{len(tasks)} row groups, {total} rows"
                 + (f", time budget {cfg.time_budget_s:.0f} s" if cfg.time_budget_s else ""))
        done = 0
        inputs_key, inputs = None, None
        last_save = time.monotonic()
        for task in tasks:
            key = (task.shape, task.sweep)
            if key != inputs_key:
                inputs = None
                timing.free_memory(dev)
                inputs_key = key
                try:
                    inputs = make_inputs(task.shape, dev)
                except Exception as err:
                    inputs = err
            if isinstance(inputs, BaseException):
                note = ("out of memory" if timing.is_oom(inputs) else "error: " + _short(inputs)) + \
                    " (allocating inputs)"
                rows = [self._finish(self._row(task, p), None, None, note) for p in task.passes]
            else:
                started = time.monotonic()
                rows = self.run_task(task, inputs)
                if task.sweep == "memory" and any(r.get("ms") is not None for r in rows):
                    self._sweep_seconds[(task.op, task.impl)] = (task.shape.seqlen, time.monotonic() - started)
            for row in rows:
                done += 1
                self.rows.append(row)
                self._progress(done, total, row)
            if time.monotonic() - last_save > 20:
                self.save()
                last_save = time.monotonic()
        inputs = None
        timing.free_memory(dev)
        self.save()
        return self.results


def device_label(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return "cpu" + (" (Triton interpreter)" if interp else "") + f" {platform.machine()}"


def result_basename(device: torch.device, date: Optional[str] = None, smoke: bool = False) -> str:
    """``<YYYY-MM-DD>-<gpu-name-slug>`` (``cpu`` for the CPU), with ``-smoke`` appended for a
    smoke run, so that its file never passes for a GPU result next to them in bench/results."""
    device = torch.device(device)
    name = slug(device_label(device)) if device.type == "cuda" else "cpu"
    return f"{date or datetime.date.today().isoformat()}-{name}{'-smoke' if smoke else ''}"
