"""The adaptive temperature's host step as one kernel: ``beta`` and ``d beta / d H`` of every row
from its entropy (``ssa_flash.temperature.beta_from_entropy`` is the definition, ~27 torch
operations, each a launch on a GPU: ~100 us of host time between the statistics pass and the
flash pass; this is one launch).

    beta = poly(H) and dbeta/dH = poly'(H) where H > threshold and poly(H) > 1, else 1 and 0

The coefficients are float32 (as torch rounds Python scalars against a float32 tensor), so this
serves float32 statistics only: float64 inputs keep the torch operations.
"""
import torch
import triton
import triton.language as tl

from . import direct, plans

BLOCK = 1024


@triton.jit
def temperature_kernel(ENT, BETA, DBETA, n, coefs, threshold, DEG: tl.constexpr, BLOCK: tl.constexpr):
    """``BETA``, ``DBETA`` from ``ENT`` (``n`` contiguous float32 values); ``coefs`` the ``DEG + 1``
    polynomial coefficients, highest degree first (Horner's rule for the value and the slope)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    h = tl.load(ENT + offs, mask=ok, other=0.0)
    p = tl.zeros_like(h)
    dp = tl.zeros_like(h)
    for i in tl.static_range(DEG + 1):
        if i < DEG:
            dp = dp * h + coefs[i] * (DEG - i)
        p = p * h + coefs[i]
    active = (h > threshold) & (p > 1.0)
    tl.store(BETA + offs, tl.where(active, p, 1.0), mask=ok)
    tl.store(DBETA + offs, tl.where(active, dp, 0.0), mask=ok)


def beta_from_entropy(entropy: torch.Tensor, poly, threshold: float):
    """``(beta, dbeta_dh)`` shaped like ``entropy`` (contiguous float32), by one launch."""
    beta, dbeta = torch.empty_like(entropy), torch.empty_like(entropy)
    n = entropy.numel()
    if n:
        grid = (-(-n // BLOCK),)
        direct.LAUNCHER.run(temperature_kernel, grid, _args(entropy, beta, dbeta, n, poly, threshold),
                            {"DEG": len(poly) - 1, "BLOCK": BLOCK}, {}, entropy.device)
    return beta, dbeta


def _args(entropy, beta, dbeta, n: int, poly, threshold: float) -> tuple:
    return (entropy, beta, dbeta, n, tuple(map(float, poly)), float(threshold))


def plan_launch(entropy: torch.Tensor, poly, threshold: float):
    """The ``plans.Launch`` of :func:`beta_from_entropy`'s launch for entropies like ``entropy``
    (its tensors: entropy, beta, dbeta), once that launch was made; None if none was kept (or
    ``entropy`` is empty)."""
    n = entropy.numel()
    if not n:
        return None
    beta = torch.empty_like(entropy)
    return plans.make_launch(temperature_kernel, (-(-n // BLOCK),), _args(entropy, beta, beta, n, poly, threshold),
                             {"DEG": len(poly) - 1, "BLOCK": BLOCK}, {}, entropy.device, (0, 1, 2))
