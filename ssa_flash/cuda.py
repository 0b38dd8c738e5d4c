"""The CUDA C++ backend (csrc/): loads the compiled extension when there is one.

The extension is not part of this version yet: ``is_available()`` is False and
``backend="cuda"`` raises ``BackendUnavailableError`` with the reason.
"""
from __future__ import annotations

import torch


def is_available() -> bool:
    """True when the CUDA extension is built (or buildable) and a CUDA device is present."""
    return False


def unavailable_reason(device: torch.device) -> str:
    return "the CUDA C++ extension is not part of this build of ssa_flash yet"


def attention(*args, **kwargs):
    raise RuntimeError(unavailable_reason(torch.device("cuda")))


def entropy(*args, **kwargs):
    raise RuntimeError(unavailable_reason(torch.device("cuda")))
