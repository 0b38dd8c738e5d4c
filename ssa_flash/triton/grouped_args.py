"""The grouped kernel arguments that are optional or come as a split pair (launch.py passes them
as tuples, or None without their feature), unpacked the one way every kernel's prologue needs them.

Each helper returns plain values whatever its switch: without the feature the values are zeros
(or 1.0), which no code reads, since every use sits under the same ``tl.constexpr`` switch. They
are not None because Triton 3.4 to 3.6 turn a helper's returned constants into tensors,
which None cannot become.
"""
import triton
import triton.language as tl

from .logits import combine_scale, softcap_ratio


@triton.jit
def logit_scales(scale, softcap, SOFTCAP: tl.constexpr, ACC: tl.constexpr):
    """``(scale, cap_a, cap_c)``: the softmax scale from its ``(hi, lo)`` pair and, under
    ``SOFTCAP``, the cap's ratio ``|scale| / c`` and the cap ``c`` (``logits.softcap_ratio``);
    1.0 and 1.0 without."""
    scale_hi, scale_lo = scale
    scale = combine_scale(scale_hi, scale_lo, ACC)
    cap_a = 1.0
    cap_c = 1.0
    if SOFTCAP:
        cap_a, cap_c = softcap_ratio(scale, softcap, ACC)
    return scale, cap_a, cap_c


@triton.jit
def window_edges(window, WINDOW: tl.constexpr):
    """``(win_left, win_right)`` of ``window = (left, right)`` under ``WINDOW`` (0, 0 without)."""
    win_left = 0
    win_right = 0
    if WINDOW:
        win_left, win_right = window
    return win_left, win_right


@triton.jit
def dropout_args(dropout, DROPOUT: tl.constexpr):
    """``(RNG, keep31, drop_scale_hi, drop_scale_lo)`` of ``dropout`` under ``DROPOUT`` (zeros
    without): the ``(seed, offset)`` tensor, the keep threshold and ``1 / (1 - p)`` split as the
    softmax scale is."""
    RNG = 0
    keep31 = 0
    drop_scale_hi = 0.0
    drop_scale_lo = 0.0
    if DROPOUT:
        RNG, keep31, drop_scale_hi, drop_scale_lo = dropout
    return RNG, keep31, drop_scale_hi, drop_scale_lo
