"""The adaptive temperature's host step for every backend: ``beta`` and ``d beta / d H`` of each
row from its entropy, by one Triton kernel where that runs (``ssa_flash.triton.temperature``),
else by the torch definition (``ssa_flash.temperature.beta_from_entropy``)."""
from __future__ import annotations

from typing import Sequence

import torch

from .. import temperature as _definition
from ..triton import direct as _direct  # neither imports Triton
from ..triton import interpreter as _interpreter

__all__ = ["beta_from_entropy"]


def beta_from_entropy(entropy: torch.Tensor, poly: Sequence[float], threshold: float):
    """``(beta, dbeta_dh)`` shaped like ``entropy``: ``ssa_flash.temperature.beta_from_entropy``,
    computed by one Triton kernel on a GPU (float32 statistics; these torch operations are a
    launch each)."""
    if _fused(entropy):
        return _triton_temperature().beta_from_entropy(entropy, poly, threshold)
    return _definition.beta_from_entropy(entropy, poly, threshold)


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
        from ..triton import temperature

        _kernel_module.append(temperature)
    return _kernel_module[0]


_kernel_module: list = []


_installed: list = []


def _triton_installed() -> bool:
    if not _installed:
        import importlib.util

        _installed.append(importlib.util.find_spec("triton") is not None)
    return _installed[0]
