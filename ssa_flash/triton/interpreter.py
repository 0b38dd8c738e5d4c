"""Whether Triton runs kernels on the CPU through its interpreter: the one answer for the Triton
launcher and the backend adaptor. Importing this module does not import Triton."""
from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter now, read as the installed
    Triton reads it: through ``triton.knobs`` from 3.4 on (``1``, ``true``, ``on``, ``yes``, any
    case), as exactly ``"1"`` before. Only the current setting: whether Triton's functions were
    made under it is ``ssa_flash.backends.triton_backend.unavailable_reason``'s question."""
    try:
        from triton import knobs
    except Exception:  # no Triton, or one older than 3.4
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return bool(knobs.runtime.interpret)
