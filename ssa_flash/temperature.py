"""The adaptive temperature of "Softmax is not Enough" (Velickovic et al. 2025, Fig. 4) as a
function of a row's entropy: O(L) per-row torch ops between the entropy pass and the flash pass.

    beta = max(poly(H), 1) if H > threshold else 1
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from .triton import direct as _direct  # neither imports Triton
from .triton import interpreter as _interpreter

DEFAULT_POLY = (-0.037, 0.481, -2.3, 4.917, -1.791)  # highest degree first
DEFAULT_THRESHOLD = 0.5


def polyval(coeffs: Sequence[float], x: torch.Tensor) -> torch.Tensor:
    """``sum_i coeffs[i] * x^(deg - i)`` (numpy.polyval's order), by Horner's rule."""
    out = torch.zeros_like(x)
    for c in coeffs:
        out = out * x + c
    return out


def poly_derivative(coeffs: Sequence[float]) -> Tuple[float, ...]:
    deg = len(coeffs) - 1
    return tuple(c * (deg - i) for i, c in enumerate(coeffs[:-1])) or (0.0,)


def beta_from_entropy(entropy: torch.Tensor, poly: Sequence[float], threshold: float):
    """Per-row ``beta`` and ``d beta / d H``.

    The derivative is ``poly'(H)`` where the temperature is active (``H > threshold`` and
    ``poly(H) > 1``) and 0 elsewhere, as autodiff of the paper's ``where``/``maximum`` gives.
    On a GPU (float32 statistics) one Triton kernel computes the same (``ssa_flash.triton.
    temperature``): these torch operations are a launch each.
    """
    if _fused(entropy):
        return _triton_temperature().beta_from_entropy(entropy, poly, threshold)
    return beta_from_entropy_torch(entropy, poly, threshold)


def _fused(entropy: torch.Tensor) -> bool:
    """Whether the Triton kernel computes the temperature: float32 contiguous statistics on a GPU
    with Triton installed and not interpreting, or in the launcher's stub mode (which measures a
    GPU's host path on the CPU)."""
    if entropy.dtype != torch.float32 or not entropy.is_contiguous() or torch.compiler.is_compiling():
        return False
    if entropy.device.type != "cuda":
        return _direct.stub_arch() is not None
    return _triton_installed() and not _interpreter.interpreting()


def _triton_temperature():
    """``ssa_flash.triton.temperature``, imported on first use (it imports Triton), then kept: an
    import statement per call costs ~1 us on the hot path."""
    if not _kernel_module:
        from .triton import temperature

        _kernel_module.append(temperature)
    return _kernel_module[0]


_kernel_module: list = []


_installed: list = []


def _triton_installed() -> bool:
    if not _installed:
        import importlib.util

        _installed.append(importlib.util.find_spec("triton") is not None)
    return _installed[0]


def beta_from_entropy_torch(entropy: torch.Tensor, poly: Sequence[float], threshold: float):
    """:func:`beta_from_entropy` in torch operations (the definition)."""
    p = polyval(poly, entropy)
    active = (entropy > threshold) & (p > 1.0)
    beta = torch.where(active, p, torch.ones_like(p))
    dbeta_dh = torch.where(active, polyval(poly_derivative(poly), entropy), torch.zeros_like(p))
    return beta, dbeta_dh
