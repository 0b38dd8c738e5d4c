"""The logit transform: from the raw dot products of a tile to base-2 logits, and the per-head
coefficients it needs.

Logits are kept in base-2 units (``l2 = l * log2(e)``) so that the exponentials are ``exp2``, and
each tile is built from the raw dot products ``s = q . k`` (the softmax scale is folded into
per-row coefficients, never applied element by element):

* softmax:  ``x = s``                                      ``l2 = x * (scale * log2(e))``
* SSA:      ``x = sgn(s) * log2(1 + scale * b * |s|)``     ``l2 = x * n``
  (= ``phi(z) * log2(e)`` with ``z = scale * s``; ``(1 + b|z|)^n`` is never formed, so large
  ``n`` or ``|z|`` cannot overflow)

With the adaptive temperature the row's ``beta`` multiplies the coefficient too, so an interior
tile turns ``x`` into its weights with one fused multiply-add and one ``exp2`` per element:
``p = exp2(x * coef_row - m_row)``. What makes an element inadmissible (sequence ends, causality,
a window, an attention mask) is applied to ``l2`` afterwards: ``masks.py``.

Soft-capping (``SOFTCAP``, docs/maths.md §6.1) replaces the scaled score ``z = scale s`` by
``z' = c tanh(z / c)`` before the transform. With ``t = tanh(|scale| s / c)`` (one multiply and one
tanh per element; ``sgn(t) = sgn(s)``, ``|z'| = c |t|``) the same formulas hold with ``t`` in place
of ``s`` and ``c`` in place of ``|scale|``: softmax ``x = t``, ``coef = c log2(e)``; SSA
``x = sgn(t) log2(1 + b c |t|)``. The sign of the scale stays in ``q_sign`` (forward) or ``coef``
(backward) as without the cap.

Attention sinks (``SINKS``, §6.2): a row starts from its sink logit instead of from nothing
(:func:`row_start`), which is all the forward and the statistics pass need.
"""
import triton
import triton.language as tl

from .fast_math import copy_sign, exp2_poly, fast_recip, fast_tanh

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def ssa_log_weight(s, cb, ACC: tl.constexpr, FAST_MATH: tl.constexpr):
    """``(x, u)`` with ``u = 1 + cb |s|`` and ``x = sgn(s) log2(1 + cb |s|)``: SSA's log-weight of
    the raw dot products ``s`` divided by ``n`` (``cb = |scale| b``). The backward needs ``u`` too.

    In float32 ``log2(u)`` of the rounded ``u`` is what the GPU computes (its absolute error,
    2^-24 from rounding ``u``, is irrelevant as argued in :func:`.fast_math.fast_log2`). In float64 (the
    gradient checks) ``log(u) * y / (u - 1)`` with ``y = cb |s|`` cancels the rounding error of
    ``u`` (Goldberg), keeping ``log1p``'s relative accuracy for small ``y``."""
    y = tl.abs(s) * cb
    u = y + 1.0
    if ACC == tl.float64:
        d = u - 1.0
        t = tl.where(d == 0.0, y * LOG2E, tl.log2(u) * (y / tl.where(d == 0.0, 1.0, d)))
        return copy_sign(t, s, ACC), u
    elif FAST_MATH:
        # MUFU.LG2, then one LOP3 (t | (s & 0x80000000); lut 0xF8) for the sign: ptxas does not
        # fuse the AND and OR of copy_sign across the opaque lg2.
        x = tl.inline_asm_elementwise(
            "{ .reg .f32 t; lg2.approx.ftz.f32 t, $1; lop3.b32 $0, t, $2, 0x80000000, 0xF8; }",
            "=f,f,f", [u, s], dtype=tl.float32, is_pure=True, pack=1)
        return x, u
    else:
        return copy_sign(tl.log2(u), s, ACC), u


@triton.jit
def capped_score(s, cap_a, SOFTCAP: tl.constexpr, ACC: tl.constexpr, FAST_MATH: tl.constexpr):
    """``t = tanh(cap_a s)`` with ``cap_a = |scale| / c`` under ``SOFTCAP`` (module docstring),
    ``s`` itself otherwise."""
    if SOFTCAP:
        return fast_tanh(s * cap_a, ACC, FAST_MATH)
    else:
        return s


@triton.jit
def tile_logit_input(s, cb, cap_a, SSA: tl.constexpr, SOFTCAP: tl.constexpr, ACC: tl.constexpr,
                     FAST_MATH: tl.constexpr):
    """``x``, the per-element input of the logit (``l2 = x * coef``): ``s`` for softmax, SSA's
    signed ``log2(1 + cb|s|)`` otherwise; ``s`` soft-capped first under ``SOFTCAP``."""
    s = capped_score(s, cap_a, SOFTCAP, ACC, FAST_MATH)
    if SSA:
        x, _ = ssa_log_weight(s, cb, ACC, FAST_MATH)
        return x
    else:
        return s


@triton.jit
def tile_logit_input_and_u(s, cb, cap_a, SSA: tl.constexpr, SOFTCAP: tl.constexpr, ACC: tl.constexpr,
                           FAST_MATH: tl.constexpr):
    """The backward's form of :func:`tile_logit_input`: ``(x, u, t)`` with SSA's ``u = 1 + cb|t|``
    (``dx/dt = cb / (u ln 2)`` up to the sign, see :func:`ssa_reciprocal`; softmax's ``x = t``
    has ``dx/dt = 1`` and ``u`` is unused, 1) and ``t`` the capped score (``s`` without
    ``SOFTCAP``), whose ``dt/ds = cap_a (1 - t^2)``."""
    t = capped_score(s, cap_a, SOFTCAP, ACC, FAST_MATH)
    if SSA:
        x, u = ssa_log_weight(t, cb, ACC, FAST_MATH)
    else:
        x = t
        u = 1.0
    return x, u, t


@triton.jit
def row_start(BLOCK_M: tl.constexpr, ACC: tl.constexpr, sink_l2, SINKS: tl.constexpr):
    """``(m, total)``: a row's running maximum of base-2 logits and its running sum of weights
    before any key is seen; the online softmax of the forward and the statistics pass starts from
    here. Without ``SINKS``: ``-inf`` and 0. With: the row's sink logit ``sink_l2`` (base 2,
    ``(BLOCK_M,)``, times ``beta`` where the temperature applies) and its weight 1, or the empty
    row again where ``sink_l2`` is ``-inf`` (no sink)."""
    if SINKS:
        return sink_l2, tl.where(sink_l2 == float("-inf"), 0.0, 1.0).to(ACC)
    else:
        return tl.full((BLOCK_M,), float("-inf"), dtype=ACC), tl.zeros((BLOCK_M,), dtype=ACC)


@triton.jit
def softcap_ratio(scale, softcap, ACC: tl.constexpr):
    """``(cap_a, c)``: ``|scale| / c`` and the cap ``c`` (``softcap = (hi, lo)`` split as the scale
    is); both unused (1) without ``SOFTCAP``."""
    c = combine_scale(softcap[0], softcap[1], ACC)
    return tl.abs(scale) / c, c


@triton.jit
def ssa_reciprocal(u, x, ROWS: tl.constexpr, COLS: tl.constexpr, FAST_MATH: tl.constexpr,
                   POLY_EXP2: tl.constexpr):
    """``1 / u`` of SSA's ``u = 1 + b|z|`` (``x = sgn(s) log2(u)``, already computed): with
    ``POLY_EXP2``, every other column is ``2^-|x|`` on the FMA pipe, the rest ``rcp.approx``."""
    if POLY_EXP2 != 0:
        u_hw, _ = tl.split(tl.reshape(u, (ROWS, COLS // 2, 2)))
        _, x_poly = tl.split(tl.reshape(x, (ROWS, COLS // 2, 2)))
        r = tl.join(fast_recip(u_hw, FAST_MATH), exp2_poly(-tl.abs(x_poly), POLY_EXP2))
        return tl.reshape(r, (ROWS, COLS))
    else:
        return fast_recip(u, FAST_MATH)


@triton.jit
def combine_scale(scale_hi, scale_lo, ACC: tl.constexpr):
    """The softmax scale as an ACC-dtype value. Python floats reach kernels as float32, so the
    launcher splits the scale into a float32 head and its remainder; in float64 they add up exactly."""
    zero = tl.zeros((1,), dtype=ACC)
    return tl.sum(zero + scale_hi, 0) + scale_lo


@triton.jit
def head_coefficients(B_SSA, N_SSA, off_h, scale, cap_c, SSA: tl.constexpr, SOFTCAP: tl.constexpr,
                      ACC: tl.constexpr):
    """``(cb, coef, q_sign)`` of one head. ``cb = |scale| * b`` is SSA's argument scale (unused for
    softmax); ``coef >= 0`` is the factor from ``x`` to base-2 logits (``|n|`` for SSA,
    ``|scale| * log2(e)`` for softmax); ``q_sign`` (+1 or -1) is the sign of ``n * scale`` (SSA)
    or ``scale`` (softmax). Kernels multiply the queries by ``q_sign`` once per program, so that
    the logits are ``x * coef`` with ``coef >= 0`` and a tile's row maximum is that of ``x``
    times ``coef`` (no per-element sign work for negative ``n`` or ``scale``). Under ``SOFTCAP``
    the cap ``cap_c`` takes the place of ``|scale|`` (module docstring)."""
    scale_sign = tl.where(scale < 0, -1.0, 1.0)
    if SSA:
        n = tl.load(N_SSA + off_h).to(ACC)
        if SOFTCAP:
            cb = tl.load(B_SSA + off_h).to(ACC) * cap_c
        else:
            cb = tl.load(B_SSA + off_h).to(ACC) * (scale * scale_sign)
        coef = tl.abs(n)
        q_sign = tl.where(n < 0, -scale_sign, scale_sign)
    else:
        cb = scale * scale_sign
        if SOFTCAP:
            cb = cap_c
        coef = cb * LOG2E
        q_sign = scale_sign
    return cb, coef, q_sign


@triton.jit
def safe_row_max(m):
    """The running max with ``-inf`` (a row with nothing admissible yet) replaced by 0, so that
    ``exp2(l2 - m)`` gives 0 instead of NaN."""
    return tl.where(m == float("-inf"), 0.0, m)
