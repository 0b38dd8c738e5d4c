"""The conventions every layer shares, each written once (the contract, with ``spec.py`` and
``scores.py``: nothing here imports another layer of the package).

* The adaptive temperature's defaults (docs/design.md §1.3): :data:`DEFAULT_POLY`,
  :data:`DEFAULT_THRESHOLD`.
* A window side without a limit: :data:`NO_WINDOW` (``window_size`` and ``AttentionSpec``'s
  ``window_left`` / ``window_right``).
* Dropout's keep rule (docs/design.md §1.5): :func:`dropout_keep_threshold`, the integer every
  kernel compares its Philox words with, and :func:`dropout_scale`, what kept weights are scaled by.
* A negative scale needs no encoding: every kernel takes the scale signed and its score policy
  folds the sign into its per-head factors (``ssa_flash/triton/logits.py``, ``head_coefficients``;
  ``csrc/logits.h``, ``setup``), negating the query tile where a forward's row multiplier would be
  negative. No backend copies ``-q``.
"""
from __future__ import annotations

__all__ = ["DEFAULT_POLY", "DEFAULT_THRESHOLD", "NO_WINDOW", "dropout_keep_threshold", "dropout_scale"]

DEFAULT_POLY = (-0.037, 0.481, -2.3, 4.917, -1.791)
"""the temperature polynomial of the entropy, highest degree first"""
DEFAULT_THRESHOLD = 0.5
"""the temperature is 1 on rows whose entropy is at most this"""

NO_WINDOW = -1
"""a side of a local window that bounds nothing (``window_size=(NO_WINDOW, NO_WINDOW)``: no window)"""


def dropout_keep_threshold(p: float) -> int:
    """``keep31 = round((1 - p) 2^31)`` (at most 2^31 - 1): an element is kept iff its 32-bit
    Philox word is below ``2 keep31``, i.e. with probability ``1 - p`` to within 2^-32."""
    return min(int(round((1.0 - float(p)) * 2.0**31)), 2**31 - 1)


def dropout_scale(p: float) -> float:
    """``1 / (1 - p)``, the factor of a kept weight; 0 for ``p = 1``, where nothing is kept."""
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0
