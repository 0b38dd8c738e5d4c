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
sequences and, under ``CAUSAL``, wholly on or below the diagonal (and, under ``WINDOW``, wholly
inside the band ``i - left <= j <= i + right``), so they need no index checks; boundary tiles
(ragged ends, the causal diagonal, the window's edges) check every element. Tiles wholly outside
the causal triangle or the window are never visited (loop bounds). An attention mask applies to
every tile. ``MASK_KIND``: 0 none, 1 boolean (True = attend), 2 additive float.

Dropout (``DROPOUT``) keeps element ``(b, h, i, j)`` of the final weights iff a Philox4x32-10
draw is below a threshold; see :func:`dropout_keep` for the exact function of (seed, offset,
batch, head, query, key), which does not depend on the tiles, so every kernel (whatever its
block sizes or orientation) regenerates the same mask.

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
                    MASK_KIND: tl.constexpr, KEYS_FIRST: tl.constexpr,
                    win_left=0, win_right=0, WINDOW: tl.constexpr = False):
    """Applies what makes an element inadmissible to the logit tile ``l2``: ``-inf`` outside the
    sequences, above the diagonal and outside the window ``q - win_left <= k <= q + win_right``
    (``BOUNDARY`` tiles only), the attention mask (every tile).
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
        if WINDOW:
            admissible = admissible & (k_idx >= q_idx - win_left) & (k_idx <= q_idx + win_right)
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
def split_key_range(lo, a, mid, hi, BLOCK_N: tl.constexpr):
    """This program's share ``(lo, a, mid, hi)`` of the key blocks ``[lo, hi)`` (boundary up to
    ``a``, interior up to ``mid``, boundary after) when ``tl.num_programs(1)`` programs split them
    (split-KV decoding): contiguous runs of ``cdiv(blocks, splits)`` blocks, the last ones possibly
    empty (``lo >= hi``)."""
    split = tl.program_id(1)
    per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N), tl.num_programs(1)) * BLOCK_N
    s_lo = lo + split * per_split
    s_hi = tl.minimum(hi, s_lo + per_split)
    s_a = tl.maximum(s_lo, tl.minimum(a, s_hi))
    s_mid = tl.maximum(s_a, tl.minimum(mid, s_hi))
    return s_lo, s_a, s_mid, s_hi


@triton.jit
def window_key_bounds(m0, hi, mid, win_left, win_right,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key-block ranges of the query block at positions ``[m0, m0 + BLOCK_M)`` under a window (``WINDOW``
    kernels; ``m0`` may be any integer, negative for a KV cache's bottom-right shift): ``(lo, a, b, hi)`` with ``[lo, a)`` boundary blocks cut by the window's left edge,
    ``[a, b)`` interior blocks and ``[b, hi)`` boundary blocks (right edge, diagonal, ragged end).
    ``hi`` and ``mid`` (the end of the interior blocks) come in with the sequence end and causality
    applied; blocks wholly outside ``m0 - win_left <= j < m0 + BLOCK_M + win_right`` are dropped.
    Every bound but ``hi`` is a multiple of BLOCK_N (``win_left``, ``win_right`` >= 0; an
    unbounded side is passed as a bound at least as long as the sequences)."""
    hi = tl.minimum(hi, m0 + BLOCK_M + win_right)
    lo = (tl.maximum(m0 - win_left, 0) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    # interior: every row's band covers the block, i.e. j >= (last row) - left and
    # j <= (first row) + right for all keys j of the block
    mid = tl.minimum(mid, (tl.maximum(m0 + win_right + 1, 0) // BLOCK_N) * BLOCK_N)
    int_lo = tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 - win_left, 0), BLOCK_N) * BLOCK_N
    a = tl.minimum(tl.maximum(int_lo, lo), hi)
    b = tl.maximum(a, tl.minimum(mid, hi))
    return lo, a, b, hi


@triton.jit
def window_query_bounds(n0, lo, diag_end, int_end, Lq, win_left, win_right,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query-block ranges of the key block ``[n0, n0 + BLOCK_N)`` under a window (the dK/dV
    kernel): ``(lo, d, e, hi)`` with ``[lo, d)`` boundary blocks (the window's right edge, the
    causal diagonal, a ragged key block), ``[d, e)`` interior blocks and ``[e, hi)`` boundary
    blocks (the left edge, the ragged end). ``lo``, ``diag_end``, ``int_end`` come in as without a
    window; queries outside ``n0 - win_right <= i < n0 + BLOCK_N + win_left`` are dropped."""
    lo = tl.maximum(lo, (tl.maximum(n0 - win_right, 0) // BLOCK_M) * BLOCK_M)
    hi = tl.minimum(Lq, n0 + BLOCK_N + win_left)
    hi = tl.maximum(hi, lo)
    # interior: i >= (last key) - right and i <= (first key) + left for every query i of the block
    d = tl.maximum(diag_end, tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - win_right, 0), BLOCK_M) * BLOCK_M)
    d = tl.minimum(tl.maximum(d, lo), hi)
    e = tl.minimum(int_end, ((n0 + win_left + 1) // BLOCK_M) * BLOCK_M)
    e = tl.maximum(d, tl.minimum(e, hi))
    return lo, d, e, hi


# Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011)
PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
PHILOX_ROUNDS = tl.constexpr(10)


def _mul_wide_asm(m: int) -> str:
    return "{ .reg .u64 t; mul.wide.u32 t, $2, %d; mov.b64 {$1, $0}, t; }" % m


PHILOX_M0_ASM = tl.constexpr(_mul_wide_asm(PHILOX_M0.value))
PHILOX_M1_ASM = tl.constexpr(_mul_wide_asm(PHILOX_M1.value))


@triton.jit
def _mulhilo32(a, m: tl.constexpr, ASM: tl.constexpr, FAST_MATH: tl.constexpr):
    """``(hi, lo)``: the 32-bit halves of the product of the uint32 tile ``a`` and ``m``. On a GPU
    one ``mul.wide.u32`` (IMAD.WIDE.U32); ptxas does not fuse the separate ``mul.hi``/``mul.lo``
    of the portable form (and a 64-bit product in Triton would stop the layout propagation that
    keeps ``dropout_keep`` free of data movement)."""
    if FAST_MATH:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r", [a], dtype=(tl.uint32, tl.uint32),
                                         is_pure=True, pack=1)
    else:
        return tl.umulhi(a, m), a * m  # uint32: wraps (Triton checks overflow only in debug mode)


@triton.jit
def philox4x32(c0, c1, c2, c3, k0, k1, FAST_MATH: tl.constexpr):
    """Philox4x32-10 of the counter ``(c0, c1, c2, c3)`` under the key ``(k0, k1)`` (uint32
    tensors / scalars): four uint32 tensors, the same bits as Random123's ``philox4x32_R(10)`` and
    cuRAND's Philox4_32_10. Each round is two 32x32->64 multiplies (IMAD.WIDE.U32 on a GPU) and
    two 3-input XORs (LOP3); the key schedule is per program (uniform registers)."""
    for _ in tl.static_range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo32(c0, PHILOX_M0, PHILOX_M0_ASM, FAST_MATH)
        hi1, lo1 = _mulhilo32(c2, PHILOX_M1, PHILOX_M1_ASM, FAST_MATH)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + PHILOX_W0
        k1 = k1 + PHILOX_W1
    return c0, c1, c2, c3


@triton.jit
def dropout_keep(seed_lo, seed_hi, head_ctr, batch_ctr, start_q, start_k, keep_below,
                 BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, KEYS_FIRST: tl.constexpr,
                 FAST_MATH: tl.constexpr):
    """The dropout keep-mask of queries ``[start_q, start_q + BLOCK_Q)`` x keys
    ``[start_k, start_k + BLOCK_K)``: a boolean tile (queries, keys), or (keys, queries) with
    ``KEYS_FIRST``. ``start_q``, ``start_k``, BLOCK_Q and BLOCK_K are multiples of 16.

    Element (b, h, i, j) is kept iff ``r < keep_below`` where ``r`` is word
    ``bit3(i) + 2 bit0(j)`` of Philox4x32-10 with key ``(seed_lo, seed_hi)`` (the 64-bit seed)
    and counter ``(j // 2, (i // 16) 8 + i % 8, h, (b + offset) mod 2^32)``; ``head_ctr = h``,
    ``batch_ctr = b + offset`` (uint32). One Philox evaluation serves the four elements
    ``{i, i + 8} x {j, j + 1}`` (i with bit 3 clear, j even): exactly what one thread holds of
    a tensor-core accumulator tile (queries x keys; mma.sync and wgmma alike: rows r and r + 8,
    columns 2t and 2t + 1), so in the forward and dQ kernels the words reach their elements with
    no data movement. The dK/dV kernel's transposed tiles hold them in other threads and pay a
    layout conversion. Nothing depends on the tile shape, so kernels with different tiles agree.
    ``ssa_flash.reference.dropout_keep_mask`` is the same function in PyTorch."""
    tl.static_assert(BLOCK_Q % 16 == 0 and BLOCK_K % 16 == 0, "dropout tiles: multiples of 16")
    HQ: tl.constexpr = BLOCK_Q // 2
    HK: tl.constexpr = BLOCK_K // 2
    # Counter words of the half tile (x' = (x // 16) 8 + x % 8 runs over start / 2 + [0, B / 2))
    # from one flat arange: no broadcast in the chain, so the compiler can place the whole
    # Philox computation in the layout the joins below need.
    flat = tl.arange(0, HQ * HK).to(tl.uint32)
    if KEYS_FIRST:
        c0 = tl.reshape(flat // HQ, (HK, HQ)) + tl.cast(start_k // 2, tl.uint32)
        c1 = tl.reshape(flat % HQ, (HK, HQ)) + tl.cast(start_q // 2, tl.uint32)
    else:
        c0 = tl.reshape(flat % HK, (HQ, HK)) + tl.cast(start_k // 2, tl.uint32)
        c1 = tl.reshape(flat // HK, (HQ, HK)) + tl.cast(start_q // 2, tl.uint32)
    zero = c0 * 0
    r0, r1, r2, r3 = philox4x32(c0, c1, zero + head_ctr, zero + batch_ctr, seed_lo, seed_hi, FAST_MATH)
    # words: r0 (i, j), r1 (i + 8, j), r2 (i, j + 1), r3 (i + 8, j + 1). tl.join adds the
    # fastest register dim: the outer join over bit0(j), the accumulators' first register bit.
    t = tl.join(tl.join(r0 < keep_below, r1 < keep_below), tl.join(r2 < keep_below, r3 < keep_below))
    if KEYS_FIRST:  # t[j', i', u, s] -> [j', s, a, u, x]
        t = tl.reshape(t, (HK, BLOCK_Q // 16, 8, 2, 2))
        return tl.reshape(tl.permute(t, (0, 4, 1, 3, 2)), (BLOCK_K, BLOCK_Q))
    else:  # t[i', j', u, s] -> [a, u, x, j', s]
        t = tl.reshape(t, (BLOCK_Q // 16, 8, HK, 2, 2))
        return tl.reshape(tl.permute(t, (0, 3, 1, 2, 4)), (BLOCK_Q, BLOCK_K))


@triton.jit
def dropout_state(RNG, off_b, off_h, keep31):
    """Per-program dropout constants from the ``(2,)`` int64 tensor ``RNG = (seed, offset)``:
    ``(seed_lo, seed_hi, head_ctr, batch_ctr, keep_below)`` as uint32 (see :func:`dropout_keep`;
    ``keep_below = 2 * keep31``, ``keep31 = round((1 - p) 2^31)``)."""
    seed = tl.load(RNG)
    offset = tl.load(RNG + 1)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    batch_ctr = ((off_b + offset) & 0xFFFFFFFF).to(tl.uint32)
    head_ctr = off_h.to(tl.uint32)
    keep_below = keep31.to(tl.uint32) * 2
    return seed_lo, seed_hi, head_ctr, batch_ctr, keep_below
