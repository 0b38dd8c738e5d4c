"""Timing, memory and FLOP accounting shared by the benchmark and ``python -m ssa_flash``.

On CUDA, times are medians over CUDA-event-timed runs after a warm-up (``triton.testing.do_bench``
with ``quantiles=[0.5]``, which also flushes the L2 cache between runs; our own CUDA-event loop
when Triton is missing). On the CPU, medians of ``time.perf_counter`` after one warm-up call.
Triton is imported lazily so that ``TRITON_INTERPRET`` can be set by the caller first.
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Optional

import torch

PASS_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, headdim: int,
                    causal: bool, pass_: str) -> float:
    """docs/design.md §4.1: forward ``4*B*H*Lq*Lk*D`` (halved for causal), backward 2.5x, fwd+bwd 3.5x."""
    fwd = 4.0 * batch * heads * seqlen_q * seqlen_k * headdim
    if causal:
        fwd /= 2.0
    return fwd * PASS_FLOP_FACTOR[pass_]


def tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(err: BaseException) -> bool:
    """Out of memory, whichever way the allocator or a kernel library reported it."""
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(err, oom_type):
        return True
    text = str(err).lower()
    return "out of memory" in text or "cuda_error_out_of_memory" in text


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _cuda_event_median(fn: Callable[[], object], warmup_ms: float, rep_ms: float,
                       max_reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 3, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    reps = min(max_reps, max(3, int(rep_ms / estimate)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25.0,
            rep_ms: float = 100.0, cpu_reps: int = 3, cpu_warmup: int = 1,
            max_reps: int = 1000) -> float:
    """Median milliseconds of ``fn()`` after warm-up.

    CUDA: ``triton.testing.do_bench(fn, warmup, rep, quantiles=[0.5])`` (CUDA events, L2 flushed
    between runs); CPU: ``cpu_warmup`` warm-up calls, then the median of ``cpu_reps`` perf_counter
    timings."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except Exception:  # Triton missing or broken: our own CUDA-event loop
            do_bench = None
        if do_bench is not None:
            res = do_bench(fn, warmup=max(1, int(warmup_ms)), rep=max(1, int(rep_ms)),
                           quantiles=[0.5])
            return float(res[0] if isinstance(res, (list, tuple)) else res)
        return _cuda_event_median(fn, warmup_ms, rep_ms, max_reps)
    for _ in range(max(0, cpu_warmup)):
        fn()
    samples = []
    for _ in range(max(1, cpu_reps)):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def time_ms_few(fn: Callable[[], object], device: torch.device, reps: int = 3) -> float:
    """Median of a few runs after one warm-up: for long runs (the memory sweep)."""
    device = torch.device(device)
    if device.type != "cuda":
        return time_ms(fn, device, cpu_reps=reps)
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(max(1, reps)):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        samples.append(s.elapsed_time(e))
    return statistics.median(samples)


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> Optional[int]:
    """Peak bytes allocated by PyTorch's CUDA allocator while ``fn()`` runs once, counting what was
    already allocated (the inputs). None on the CPU (no allocator statistics there)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int = 8192, *,
                  warmup_ms: float = 25.0, rep_ms: float = 100.0) -> Optional[float]:
    """Dense ``size x size @ size x size`` matmul rate in TFLOP/s in ``dtype`` (2*size^3 FLOPs)."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    try:
        ms = time_ms(lambda: a @ b, device, warmup_ms=warmup_ms, rep_ms=rep_ms)
    finally:
        del a, b
        free_memory(device)
    return tflops(2.0 * size ** 3, ms)
