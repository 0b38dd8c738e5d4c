"""The CUDA C++ backend's user-facing helpers (building, availability, what it runs).

The backend itself, with the extension loader and the Python glue around the kernels, is
:mod:`ssa_flash.backends.cuda_backend`; this module re-exports what users and tools ask for and is not
imported by the package's own layers (so it may sit on top of them):

* :func:`is_available`, :func:`ready`, :func:`unavailable_reason`, :func:`supports`,
  :func:`load_extension`, :func:`source_dir`, :data:`VERIFIED_ARCHS`, :func:`emulated`;
* :func:`preferred_backend`: measures whether the CUDA or the Triton backend is faster on a GPU;
* :class:`CudaAttentionFunction`: the former autograd entry point, kept for callers such as
  ``tests/emu_harness.py``; it now runs through the package's custom ops.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .backends import cuda_backend as _backend
from .backends import preferred_backend
from .backends.cuda_backend import (MAX_HEAD_DIM, NVCC_FLAGS, SUPPORTED_DTYPES, VERIFIED_ARCHS,  # noqa: F401
                            _padded_head_dim, _smem_bytes, active_emulator, emulated, is_available,
                            load_extension, ready, source_dir, verified)
from .spec import AttentionSpec

__all__ = [
    "is_available",
    "ready",
    "verified",
    "unavailable_reason",
    "supports",
    "load_extension",
    "source_dir",
    "preferred_backend",
    "emulated",
    "VERIFIED_ARCHS",
    "CudaAttentionFunction",
]


def unavailable_reason(device) -> str:
    """Why ``backend="cuda"`` cannot run on ``device`` (empty string if it can)."""
    return _backend.unavailable_reason(torch.device(device)) or ""


def supports(query, key, value, adaptive: bool = False, score: str = "softmax") -> Optional[str]:
    """None if the CUDA kernels can run these inputs on their device with score function ``score``
    (``ssa_flash.scores``), else the reason (a sentence). Looks at dtypes, shapes and the device only
    (no synchronisation)."""
    return _backend.supports(query, key, value, AttentionSpec(scale=1.0, adaptive=adaptive, score=score))


class CudaAttentionFunction:
    """``CudaAttentionFunction.apply(q, k, v, b, n, mask, scale, causal, group, adaptive, poly,
    threshold, ext=None) -> (out, lse)``, differentiable in q, k, v, b, n, through
    ``torch.ops.ssa_flash.attn_fwd`` with ``backend="cuda"``. ``ext``: an object standing in for
    the extension (the CPU emulation of ``csrc/emu``), used for CPU tensors, backward included.
    Tensors as the backend interface takes them (``ssa_flash.spec``). New code: the
    public functions, or ``with emulated(ext): ssa_attention(..., backend="cuda")``."""

    @staticmethod
    def apply(q, k, v, b, n, mask, scale: float, causal: bool, group: int, adaptive: bool,
              poly: Sequence[float], threshold: float, ext=None):
        from .autograd import attention  # the op layer sits above the backends

        spec = AttentionSpec(scale=float(scale), score="softmax" if b is None else "ssa", causal=bool(causal),
                             group=int(group), adaptive=bool(adaptive), poly=tuple(poly), threshold=float(threshold))
        with emulated(ext):
            why = _backend.supports(q, k, v, spec)
            if why is not None:
                raise _backend.BackendUnavailableError(f"backend='cuda' cannot run these inputs: {why}")
            return attention(q, k, v, () if b is None else (b, n), mask, "cuda", spec)
