"""The conventions every layer shares, each written once (the contract, with ``spec.py`` and
``scores.py``: nothing here imports another layer of the package).

* The adaptive temperature's defaults (docs/design.md §1.3): :data:`DEFAULT_POLY`,
  :data:`DEFAULT_THRESHOLD`.
* A window side without a limit: :data:`NO_WINDOW`, the one marker (``window_size`` and
  ``AttentionSpec``'s ``window_left`` / ``window_right``), and :func:`kernel_window`, the window as
  every backend passes it to its kernels.
* Dropout's keep rule (docs/design.md §1.5): :func:`dropout_keep_threshold`, the integer every
  kernel compares its Philox words with, and :func:`dropout_scale`, what kept weights are scaled by.
"""
from __future__ import annotations

from typing import Optional, Tuple

__all__ = ["DEFAULT_POLY", "DEFAULT_THRESHOLD", "NO_WINDOW", "kernel_window", "dropout_keep_threshold",
           "dropout_scale"]

DEFAULT_POLY = (-0.037, 0.481, -2.3, 4.917, -1.791)
"""the temperature polynomial of the entropy, highest degree first"""
DEFAULT_THRESHOLD = 0.5
"""the temperature is 1 on rows whose entropy is at most this"""

NO_WINDOW = -1
"""a side of a local window that bounds nothing (``window_size=(NO_WINDOW, NO_WINDOW)``: no window)"""


def kernel_window(window_left: int, window_right: int, causal: bool, len_q: int,
                len_k: int) -> Optional[Tuple[int, int]]:
    """The local window ``j - i`` in ``[-left, right]`` as the kernels take it: None where no side
    bounds anything (both :data:`NO_WINDOW`, or only the right side given under ``causal``, which
    causality bounds already): the kernels then run without a window. Otherwise ``(left, right)``,
    both in ``[0, len_q + len_k]``: a side without a limit, or one past every index difference,
    is ``len_q + len_k``, which no difference of a query's and a key's position reaches (a KV
    cache's bottom-right shift included). Under ``causal`` each kernel takes ``j <= i`` in place
    of the right side."""
    if window_left < 0 and (window_right < 0 or causal):
        return None
    reach = len_q + len_k
    return (reach if window_left < 0 else min(window_left, reach),
            reach if window_right < 0 else min(window_right, reach))


def dropout_keep_threshold(p: float) -> int:
    """``keep31 = round((1 - p) 2^31)`` (at most 2^31 - 1): an element is kept iff its 32-bit
    Philox word is below ``2 keep31``, i.e. with probability ``1 - p`` to within 2^-32."""
    return min(int(round((1.0 - float(p)) * 2.0**31)), 2**31 - 1)


def dropout_scale(p: float) -> float:
    """``1 / (1 - p)``, the factor of a kept weight; 0 for ``p = 1``, where nothing is kept."""
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0
