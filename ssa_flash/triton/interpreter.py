"""Whether Triton runs kernels on the CPU through its interpreter: the one answer for the Triton
launcher and the backend adaptor. Importing this module does not import Triton."""
from __future__ import annotations

import os
import sys
from typing import Optional


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter now, read as the installed
    Triton reads it: through ``triton.knobs`` from 3.4 on (``1``, ``true``, ``on``, ``yes``, any
    case), as exactly ``"1"`` before. Only the current setting: whether Triton's functions were
    made under it is ``ssa_flash.backends.triton_backend.unavailable_reason``'s question. The
    answer is kept per value of the variable (the hot path asks on every call); a knob set in code
    rather than through the environment is not seen."""
    raw = environ_get("TRITON_INTERPRET")
    answer = _answers.get(raw)
    if answer is None:  # the knob's reading of this value of the variable, once per value
        try:
            from triton import knobs
        except Exception:  # no Triton, or one older than 3.4
            answer = raw == "1"
        else:
            answer = bool(knobs.runtime.interpret)
        _answers[raw] = answer
    return answer


_answers: dict = {}


# os.environ's own store (POSIX: bytes keys and values, kept in step with os.environ by its
# __setitem__ / __delitem__): a lookup there is one C call, where os.environ.get is four Python
# calls, and the hot path reads three variables per call
_store = getattr(os.environ, "_data", None)
_direct = os.name == "posix" and isinstance(_store, dict)
_encoding = sys.getfilesystemencoding()


def environ_get(name: str, default: Optional[str] = None) -> Optional[str]:
    """``os.environ.get(name, default)``."""
    if _direct:
        raw = _store.get(name.encode(_encoding, "surrogateescape"))
        return default if raw is None else raw.decode(_encoding, "surrogateescape")
    return os.environ.get(name, default)
