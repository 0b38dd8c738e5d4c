"""Pieces shared by the forward, statistics and backward kernels.

Logits are kept in base-2 units (``l2 = l * log2(e)``) so that the exponentials are ``exp2``, and
each tile is built from the raw dot products ``s = q . k`` (the softmax scale is folded into
per-row coefficients, never applied element by element):

* softmax:  ``x = s``                                      ``l2 = x * (scale * log2(e))``
* SSA:      ``x = sgn(s) * log2(1 + scale * b * |s|)``     ``l2 = x * n``
  (= ``phi(z) * log2(e)`` with ``z = scale * s``; ``(1 + b|z|)^n`` is never formed, so large
  ``n`` or ``|z|`` cannot overflow)

With the adaptive temperature the row's ``beta`` multiplies the coefficient too, so an interior
tile turns ``x`` into its weights with one fused multiply-add and one ``exp2`` per element:
``p = exp2(x * coef_row - m_row)``.

Tiles come in two kinds, chosen at compile time (``BOUNDARY``): interior tiles lie inside the
sequences and, under ``CAUSAL``, wholly on or below the diagonal, so they need no index checks;
boundary tiles (ragged ends, the causal diagonal) check every element. An attention mask applies
to every tile. ``MASK_KIND``: 0 none, 1 boolean (True = attend), 2 additive float.

Where a program's sequence lies is the ``VARLEN`` switch (resolved in each kernel's prologue, before
any loop; the loops see only ``Lq``, ``Lk`` and the query positions ``offs_m``):

* ``VARLEN_NONE``: dense ``(B, H, L, D)`` tensors, every batch element has ``Lq`` queries, ``Lk`` keys.
* ``VARLEN_PACKED``: a packed batch. Tensors are ``(total, H, D)``, passed to the kernels as
  ``(1, H, total, D)`` views; sequence ``s`` owns query rows ``cu_q[s]:cu_q[s+1]`` and key rows
  ``cu_k[s]:cu_k[s+1]``, read from ``CU_Q``/``CU_K``; per-row statistics are ``(H, total_q)``.
  The grid is sized by the longest sequence; programs past their sequence's end return at once.
* ``VARLEN_CACHE`` / ``VARLEN_CACHE_START``: a KV cache. Batch element ``b`` attends key rows
  ``[start_b, min(seqused_k[b], Lk))`` (``start_b`` read from ``CU_K`` with ``_START``, else 0), and
  causality is bottom-right: query ``i`` is at key position ``Lk_b - Lq + i``. The kernels hand the
  loops shifted query positions ``offs_m + (Lk_b - Lq)`` and the bound ``Lq + (Lk_b - Lq)``, so the
  loops' ``k <= q`` and ``q < Lq`` checks are the bottom-right rule unchanged. With ``SPLIT`` the keys
  are shared among ``tl.num_programs(1)`` programs, each writing a partial result that
  ``splitkv.py`` merges by log-sum-exp.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

MASK_NONE = 0
MASK_BOOL = 1
MASK_ADD = 2

VARLEN_NONE = 0
VARLEN_PACKED = 1
VARLEN_CACHE = 2
VARLEN_CACHE_START = 3


@triton.jit
def fast_log2(u, FAST_MATH: tl.constexpr):
    """``log2(u)`` for ``u >= 1``. On a GPU in float32 (``FAST_MATH``) this is the hardware
    ``lg2.approx.ftz.f32`` (one MUFU op, absolute error below 2^-22 on [1, 2) and relative error
    below 2^-22 above, PTX ISA) instead of libdevice's 27-instruction software log. Softmax is
    shift-invariant per row, so what matters is the absolute error of the log-weight: ``n * 2^-22``
    (plus ``2^-24`` from rounding ``1 + b|z|``), far below the 2^-8 .. 2^-11 relative rounding of
    the fp16/bf16 weights that feed the second matmul. The interpreter (and float64) run
    ``tl.log2``; tests/test_fast_math.py bounds what the approximation costs."""
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
def copy_sign(t, s, ACC: tl.constexpr):
    """``t`` with the sign of ``s`` (``t >= 0``). In float32 a single bitwise op (LOP3)."""
    if ACC == tl.float32:
        bits = (t.to(tl.uint32, bitcast=True)
                | (s.to(tl.uint32, bitcast=True) & 0x80000000))
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.where(s < 0, -t, t)


@triton.jit
def ssa_log_weight(s, cb, ACC: tl.constexpr, FAST_MATH: tl.constexpr):
    """``(x, u)`` with ``u = 1 + cb |s|`` and ``x = sgn(s) log2(1 + cb |s|)``: SSA's log-weight of
    the raw dot products ``s`` divided by ``n`` (``cb = |scale| b``). The backward needs ``u`` too.

    In float32 ``log2(u)`` of the rounded ``u`` is what the GPU computes (its absolute error,
    2^-24 from rounding ``u``, is irrelevant as argued in :func:`fast_log2`). In float64 (the
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
def tile_logit_input(s, cb, SSA: tl.constexpr, ACC: tl.constexpr, FAST_MATH: tl.constexpr):
    """``x``, the per-element input of the logit (``l2 = x * coef``): ``s`` for softmax, SSA's
    signed ``log2(1 + cb|s|)`` otherwise."""
    if SSA:
        x, _ = ssa_log_weight(s, cb, ACC, FAST_MATH)
        return x
    else:
        return s


@triton.jit
def boundary_logits(l2, offs_q, offs_k, Lq, Lk, mask_ptr, stride_mask_m, stride_mask_n,
                    mask_scale, BOUNDARY: tl.constexpr, CAUSAL: tl.constexpr,
                    MASK_KIND: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """Applies what makes an element inadmissible to the logit tile ``l2``: ``-inf`` outside the
    sequences and above the diagonal (``BOUNDARY`` tiles only), the attention mask (every tile).
    The tile is (queries, keys), or (keys, queries) with ``KEYS_FIRST`` (the dK/dV kernel's
    transposed tiles). An additive mask (natural-log units) is multiplied by ``mask_scale``
    (``log2(e)``, times the query's temperature if any; broadcastable to the tile). Interior
    tiles without a mask return ``l2`` untouched: this function then costs nothing."""
    if KEYS_FIRST:
        q_idx = offs_q[None, :]
        k_idx = offs_k[:, None]
    else:
        q_idx = offs_q[:, None]
        k_idx = offs_k[None, :]
    if BOUNDARY:
        admissible = (q_idx < Lq) & (k_idx < Lk)  # audit: boundary-only
        if CAUSAL:
            admissible = admissible & (k_idx <= q_idx)
    if MASK_KIND != 0:
        # int64: a materialised (Lq, Lk) mask passes 2^31 elements at Lq = Lk = 46341. Rows past
        # Lq (a ragged last query block) read row Lq - 1 and are never used.
        rows = tl.minimum(q_idx, Lq - 1).to(tl.int64)
        mask_ptrs = mask_ptr + rows * stride_mask_m + k_idx.to(tl.int64) * stride_mask_n
        if BOUNDARY:
            raw = tl.load(mask_ptrs, mask=admissible, other=0)
        else:
            raw = tl.load(mask_ptrs)
        if MASK_KIND == 1:
            if BOUNDARY:
                admissible = admissible & (raw != 0)
            else:
                admissible = raw != 0
        else:
            l2 = l2 + raw.to(l2.dtype) * mask_scale
    if BOUNDARY or MASK_KIND == 1:
        l2 = tl.where(admissible, l2, float("-inf"))
    return l2


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
def head_coefficients(B_SSA, N_SSA, off_h, scale, SSA: tl.constexpr, ACC: tl.constexpr):
    """``(cb, coef, q_sign)`` of one head. ``cb = |scale| * b`` is SSA's argument scale (unused for
    softmax); ``coef >= 0`` is the factor from ``x`` to base-2 logits (``|n|`` for SSA,
    ``|scale| * log2(e)`` for softmax); ``q_sign`` (+1 or -1) is the sign of ``n * scale`` (SSA)
    or ``scale`` (softmax). Kernels multiply the queries by ``q_sign`` once per program, so that
    the logits are ``x * coef`` with ``coef >= 0`` and a tile's row maximum is that of ``x``
    times ``coef`` (no per-element sign work for negative ``n`` or ``scale``)."""
    scale_sign = tl.where(scale < 0, -1.0, 1.0)
    if SSA:
        n = tl.load(N_SSA + off_h).to(ACC)
        cb = tl.load(B_SSA + off_h).to(ACC) * (scale * scale_sign)
        coef = tl.abs(n)
        q_sign = tl.where(n < 0, -scale_sign, scale_sign)
    else:
        cb = scale * scale_sign
        coef = cb * LOG2E
        q_sign = scale_sign
    return cb, coef, q_sign


@triton.jit
def safe_row_max(m):
    """The running max with ``-inf`` (a row with nothing admissible yet) replaced by 0, so that
    ``exp2(l2 - m)`` gives 0 instead of NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def interior_end(start, length, BLOCK: tl.constexpr):
    """The end of the full blocks of ``[start, length)`` (a multiple of BLOCK past ``start``)."""
    return start + ((length - start) // BLOCK) * BLOCK


@triton.jit
def packed_extent(CU_SEQLENS, off_b):
    """``(start, length)`` of packed sequence ``off_b``: ``start`` (int64) is its first row in the
    packed tensor, ``length`` (int32) its number of rows."""
    start = tl.load(CU_SEQLENS + off_b)
    return start.to(tl.int64), tl.load(CU_SEQLENS + off_b + 1) - start


@triton.jit
def cache_key_extent(K_START, SEQUSED_K, off_b, Lk, HAS_START: tl.constexpr):
    """``(start, length)`` of the keys batch element ``off_b`` attends in a KV cache of ``Lk`` rows:
    rows ``[start, end)`` with ``end = min(seqused_k[b], Lk)`` and ``start = min(k_start[b], end)``
    (0 without ``HAS_START``); clamped so that no row outside the cache is ever read."""
    end = tl.minimum(tl.maximum(tl.load(SEQUSED_K + off_b), 0), Lk)
    if HAS_START:
        start = tl.minimum(tl.maximum(tl.load(K_START + off_b), 0), end)
    else:
        start = end * 0
    return start.to(tl.int64), end - start


@triton.jit
def split_key_range(lo, mid, hi, BLOCK_N: tl.constexpr):
    """This program's share ``(lo, mid, hi)`` of the key blocks ``[lo, hi)`` (interior up to ``mid``)
    when ``tl.num_programs(1)`` programs split them (split-KV decoding): contiguous runs of
    ``cdiv(blocks, splits)`` blocks, the last ones possibly empty (``lo >= hi``)."""
    split = tl.program_id(1)
    per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N), tl.num_programs(1)) * BLOCK_N
    s_lo = lo + split * per_split
    s_hi = tl.minimum(hi, s_lo + per_split)
    s_mid = tl.maximum(s_lo, tl.minimum(mid, s_hi))
    return s_lo, s_mid, s_hi
