"""What a kernel's program does before its loops, in one place for the four kernels: the grouped
arguments it unpacks that are optional or come as a split pair (launch.py passes them as tuples,
or None without their feature) and its query tile.

Each unpacking helper returns plain values whatever its switch: without the feature they are zeros
(or 1.0), which no code reads, since every use sits under the same ``tl.constexpr`` switch. They
are not None because Triton 3.4 to 3.6 turn a helper's returned constants into tensors, which
None cannot become.
"""
import triton
import triton.language as tl

from .dropout import dropout_state
from .extents import tile_ptrs
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
def dropout_stream(dropout, off_b, off_h, DROPOUT: tl.constexpr):
    """The keep mask's random stream of (batch element ``off_b``, head ``off_h``) under ``DROPOUT``:
    :func:`~.dropout.dropout_state`'s tuple of ``dropout = (RNG, keep31, drop_scale_hi,
    drop_scale_lo)`` (zeros without)."""
    drop = (0, 0, 0, 0, 0)
    if DROPOUT:
        RNG, keep31, drop_scale_hi, drop_scale_lo = dropout
        drop = dropout_state(RNG, off_b, off_h, keep31)
    return drop


@triton.jit
def dropout_scale(dropout, DROPOUT: tl.constexpr, ACC: tl.constexpr):
    """``1 / (1 - p)`` from its split pair in ``dropout`` under ``DROPOUT`` (1.0 without)."""
    drop_scale = 1.0
    if DROPOUT:
        RNG, keep31, drop_scale_hi, drop_scale_lo = dropout
        drop_scale = combine_scale(drop_scale_hi, drop_scale_lo, ACC)
    return drop_scale


@triton.jit
def signed_query_tile(Q, q_base, q_strides, off_h, offs_m, offs_d, row_ok, D, q_sign):
    """The program's ``(BLOCK_M, BLOCK_D)`` query tile of head ``off_h`` (rows ``offs_m`` past
    ``q_base``, zero outside ``row_ok`` and the head dim ``D``) times the head's sign ``q_sign``
    (``logits.head_coefficients``), in ``Q``'s dtype."""
    q = tl.load(tile_ptrs(Q, q_base, q_strides, off_h, offs_m, offs_d), mask=row_ok[:, None] & (offs_d[None, :] < D),
                other=0.0)
    return (q * q_sign).to(Q.dtype.element_ty)
