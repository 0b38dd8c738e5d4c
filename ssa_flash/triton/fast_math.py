"""Fast arithmetic of the kernels' inner loops: the GPU's one-instruction approximations
(``lg2.approx``, ``rcp.approx``, ``tanh.approx``, under ``FAST_MATH``, i.e. on a GPU in float32 accumulation; the
interpreter and float64 run exact maths), a sign copy in one bitwise op, and ``exp2`` by a
polynomial on the FMA pipe (``POLY_EXP2``) to take work off the MUFU unit.
"""
import triton
import triton.language as tl


@triton.jit
def fast_log2(u, FAST_MATH: tl.constexpr):
    """``log2(u)`` for ``u >= 1``. On a GPU in float32 (``FAST_MATH``) this is the hardware
    ``lg2.approx.ftz.f32`` (one MUFU op, absolute error below 2^-22 on [1, 2) and relative error
    below 2^-22 above, PTX ISA) instead of libdevice's 27-instruction software log. Softmax is
    shift-invariant per row, so what matters is the absolute error of the log-weight: ``n * 2^-22``
    (plus ``2^-24`` from rounding ``1 + b|z|``), far below the 2^-8 .. 2^-11 relative rounding of
    the fp16/bf16 weights that feed the second matmul. The interpreter (and float64) run
    ``tl.log2``; tests/triton/test_fast_math.py bounds what the approximation costs."""
    if FAST_MATH:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [u],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.log2(u)


@triton.jit
def fast_recip(u, FAST_MATH: tl.constexpr):
    """``1 / u`` for ``u >= 1``: ``rcp.approx.ftz.f32`` (one MUFU op, relative error below 2^-23)
    on a GPU in float32, an exact division elsewhere."""
    if FAST_MATH:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [u],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / u


@triton.jit
def fast_tanh(y, ACC: tl.constexpr, FAST_MATH: tl.constexpr):
    """``tanh(y)`` (soft-capping). On a GPU in float32 (``FAST_MATH``) the hardware
    ``tanh.approx.f32`` (one MUFU op, sm_75+; absolute error about 2^-11, what FlashAttention's
    soft-capping uses too); elsewhere (the interpreter, which cannot run inline PTX, and float64)
    ``sgn(y) (1 - e) / (1 + e)`` with ``e = exp(-2|y|)``, exact to rounding (absolute error
    ~1e-16 in float64, enough for the gradient checks)."""
    if FAST_MATH:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [y],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        e = tl.exp(-2.0 * tl.abs(y))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(y < 0, -t, t)


@triton.jit
def copy_sign(t, s, ACC: tl.constexpr):
    """``t`` with the sign of ``s`` (``t >= 0``). In float32 a single bitwise op (LOP3)."""
    if ACC == tl.float32:
        bits = (t.to(tl.uint32, bitcast=True)
                | (s.to(tl.uint32, bitcast=True) & 0x80000000))
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.where(s < 0, -t, t)



@triton.jit
def exp2_poly(x, DEGREE: tl.constexpr):
    """``2^x`` for ``x <= 0`` on the FMA pipe instead of the MUFU unit: round ``x`` to ``j + f``
    (``|f| <= 1/2``) with the 1.5 * 2^23 trick, a minimax polynomial for ``2^f`` (relative error
    7.5e-5 at degree 3, 2.6e-6 at degree 4), and ``j`` added to the exponent bits.
    ``x`` is clamped at -126 so the exponent cannot wrap (the result is then ~1e-38)."""
    x = tl.maximum(x, -126.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    if DEGREE == 3:
        p = f * 0.05517165928821365 + 0.2426111583127199
        p = p * f + 0.6932609904728981
        p = p * f + 0.9999280714625878
    else:
        p = f * 0.009570100784094435 + 0.055917865312126704
        p = p * f + 0.24024744899936581
        p = p * f + 0.6931218141369884
        p = p * f + 0.9999992614102138
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def exp2_half_poly(arg, ROWS: tl.constexpr, COLS: tl.constexpr, POLY_EXP2: tl.constexpr):
    """``exp2(arg)`` of a (ROWS, COLS) tile with ``arg <= 0``: with ``POLY_EXP2`` (a degree),
    every other column on the FMA pipe (:func:`exp2_poly`) and the rest on the MUFU unit.
    Neighbouring columns sit in one thread's registers in the matmul layouts, so the split and
    the join move no data (checked in the audit: no shared-memory traffic appears)."""
    if POLY_EXP2 != 0:
        a_hw, a_poly = tl.split(tl.reshape(arg, (ROWS, COLS // 2, 2)))
        return tl.reshape(tl.join(tl.exp2(a_hw), exp2_poly(a_poly, POLY_EXP2)), (ROWS, COLS))
    else:
        return tl.exp2(arg)
