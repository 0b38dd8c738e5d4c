"""Benchmark harness: ``python -m ssa_flash.bench`` (``--help`` for options, ``--smoke`` for the
CPU smoke mode through the Triton interpreter).

Measures forward, backward and forward+backward (median after warm-up, CUDA events) of our
Triton / CUDA backends (softmax, SSA, adaptive, SSA+adaptive), SDPA's flash / efficient / cuDNN /
math backends (softmax), ``torch.compile``d FlexAttention computing SSA, and the naive reference,
on docs/design.md §4.1's shapes; the dense matmul rate of the same run; forward+backward peak memory vs
sequence length up to 128k. Writes ``<out>/<YYYY-MM-DD>-<gpu>.json`` (docs/design.md §4.2) and PNG plots,
and prints the ratio tables. See docs/benchmarks.md.

Nothing here imports Triton at import time, so ``TRITON_INTERPRET`` can still be set afterwards.
"""
from .impls import IMPLS, OPS, PASSES, Shape
from .runner import Config, Runner, result_basename
from .timing import attention_flops, matmul_tflops, peak_memory_bytes, time_ms

__all__ = ["Config", "Runner", "Shape", "IMPLS", "OPS", "PASSES", "attention_flops", "time_ms",
           "peak_memory_bytes", "matmul_tflops", "result_basename"]
