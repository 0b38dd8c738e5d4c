"""The adaptive temperature of "Softmax is not Enough" (Velickovic et al. 2025, Fig. 4) as a
function of a row's entropy: O(L) per-row torch ops between the entropy pass and the flash pass
(the definition; part of the contract, it imports no other layer).

    beta = max(poly(H), 1) if H > threshold else 1
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from .conventions import DEFAULT_POLY, DEFAULT_THRESHOLD

__all__ = ["DEFAULT_POLY", "DEFAULT_THRESHOLD", "polyval", "poly_derivative", "beta_from_entropy"]


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
    """Per-row ``beta`` and ``d beta / d H``, in torch operations (the definition).

    The derivative is ``poly'(H)`` where the temperature is active (``H > threshold`` and
    ``poly(H) > 1``) and 0 elsewhere, as autodiff of the paper's ``where``/``maximum`` gives.
    On a GPU one Triton kernel computes the same (``ssa_flash.triton.temperature``; the backends
    choose it: ``ssa_flash.backends.beta_from_entropy``)."""
    p = polyval(poly, entropy)
    active = (entropy > threshold) & (p > 1.0)
    beta = torch.where(active, p, torch.ones_like(p))
    dbeta_dh = torch.where(active, polyval(poly_derivative(poly), entropy), torch.zeros_like(p))
    return beta, dbeta_dh
