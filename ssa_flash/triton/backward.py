"""Backward kernels (docs/design.md §1.2 and §1.3), in two launches with no atomics:

1. ``attention_bwd_dq_kernel``, one program per query block: ``delta = rowsum(dO * O) - dlse`` and the
   LSE in base 2 (both stored for kernel 2), ``dQ``, the
   per-row temperature gradient ``g`` (adaptive) and per-block partial sums of the score
   function's parameter gradients (``db``, ``dn`` for SSA, ``d s_h`` for the logit scale).
2. ``attention_bwd_dkdv_kernel``, one program per key block of a key/value head: ``dK``, ``dV``,
   summing over the query heads of its GQA group in registers. Its tiles are transposed
   (keys x queries: ``S^T = K Q^T``) so that all three of its matmuls have the key block as their
   M dimension, which is what the warps split (FlashAttention-2/3's layout): no warp repeats
   another's tensor work whatever the number of warps.

Notation per tile, with ``s = q . k`` the raw dot products, ``S' = beta * l`` and ``P' = softmax(S')``
the output weights:

    dS'  = P' * (dO V^T - delta)                        (FlashAttention-2's dS, on S')
    dl   = beta * dS' - g * P * (log P + H)              (g = 0 and beta = 1 without ADAPTIVE)
    ds   = dl * dl/ds,  dl/ds = scale (softmax),  n b scale / (1 + b|z|) (SSA),  s_h scale (logit scale)
    dQ   = ds K,   dK = ds^T Q,   dV = P'^T dO
    db   = sum dl * n z / (1 + b|z|) = (1/b) sum_i q_i . dQ_i,   dn = sum dl * sgn(z) log1p(b|z|)
    d s_h = sum dl * z = (1/s_h) sum_i q_i . dQ_i  (logit scale)

The score function's part of each step (its ``x``, ``dl/ds``, the parameters' gradient terms) is
in ``logits.py``, selected by the ``SCORE`` constexpr.

Dropout (``DROPOUT``, docs/design.md §1.5): with ``M`` the keep mask (regenerated, see
``dropout.dropout_keep``) and ``r = 1 / (1 - p)`` the output is ``(r M * P') V``, so
``dV = (r M * P')^T dO`` and ``dP'`` becomes ``r M * (dO V^T)``; ``delta = rowsum(dO * O)`` is
unchanged (FlashAttention-2's argument), and so is everything after ``dS'``.

Under ``WINDOW`` the loops skip blocks outside the band and treat the blocks its edges cut as
boundary blocks, as in the forward.

The identity for ``db`` holds because the logits depend on ``b`` and ``q`` only through
``b z`` and ``sgn(z)``: scaling ``b`` is scaling ``q`` (likewise ``s_h z``). So ``db`` costs no work per element; the
dQ kernel takes it from its dQ accumulator once per row (``n scale sum_d q dQ_unscaled``, no
division by ``b``).

The constant factors (``scale``, ``n b scale``, ``n scale``, ``sgn(scale) ln 2``) are applied once
per row or per program, not per element, and ``dn`` is accumulated without dividing by ``n``
(``n = 0`` is legal: uniform weights). No row maxima are needed (the forward's LSE normalises),
so the backward keeps the sign of ``n`` and of the scale in the logit coefficient.

``g_i = dbeta_i * dbeta/dH_i`` needs ``dbeta_i = sum_j dS'_ij l_ij`` over the whole row before any
``dl`` is known. It is summed centred, ``sum_j dS'_ij (l_ij - lse^l_i) + lse^l_i dlse_i`` (the
same, since ``sum_j dS'_ij = dlse_i``, the sink's entry included): the plain sum of terms the size
of the logits cancels to a small result, and rounding in ``P'`` became an error of ``lse^l`` times
it (docs/maths.md, the adaptive temperature's backward). Kernel 1 owns whole rows, so it
accumulates the ``beta dS'`` part and the ``P (log P + H)`` part of every row-sum separately and
combines them with ``g`` at the end; kernel 2 then reads ``g``. A caller holding only a shard
of the keys (ring attention) cannot get ``dbeta`` from one launch: it reads each shard's partial
(centred) ``dbeta`` out of ``G`` (a launch with ``dbeta/dH = 1``), sums them, and launches again
with ``G_GIVEN`` (kernel 1 then loads the whole row's ``g`` instead of computing it;
``G_GIVEN=False``, the default, compiles as before). The ``db``/``dn`` partials are reduced in a
fixed order afterwards, so the backward is deterministic.

Soft-capping (``SOFTCAP``, docs/maths.md §6.1): the tiles recompute the capped score ``t`` (logits.py)
and ``ds`` gains the factor ``dz'/dz = 1 - t^2``; ``db`` is then accumulated per element
(``n c sgn(scale) sum dl t / u``: the identity above no longer holds, ``b`` multiplying the capped
score). Sinks (``SINKS``, §6.2): the LSE the forward stored includes the sink, so the keys' terms
are unchanged; kernel 1 adds the sink's term of ``dbeta`` and writes one partial sum of
``d s_h = sum_i [beta_i dS'_i,sink - g_i P_i,sink (log P_i,sink + H_i)]`` per program
(``dS'_sink = -P'_sink delta``), reduced in a fixed order like ``db``. Kernel 2 needs no change.
"""
import triton
import triton.language as tl

from .dropout import tile_keep
from .extents import (interior_end, key_block_rows, query_block_rows, query_rows, row_stat_base, rows_base, stage_range,
                      tile_ptrs, window_key_bounds, window_query_bounds)
from .logits import (LN2, LOG2E, SOFTMAX_ID, bwd_head_coefficients, dq_tile_terms, dscore_factor, safe_row_max,
                     store_param_grads, tile_logit_input_and_u)
from .lse_residual import needs_residual, residual, row_residual_blocks, row_start_pair
from .masks import boundary_logits
from .prologue import dropout_scale, dropout_stream, logit_scales, window_edges


@triton.jit
def _masked_lse2(lse):
    """Natural-log LSE to base 2; ``-inf`` (empty row) becomes 0 so that ``exp2(-inf - lse)`` is 0."""
    return safe_row_max(lse * LOG2E)


@triton.jit
def _dq_key_blocks(dq, dq_ent, acc1, ent1, dbeta, acc0, ent0,
                   q, do, k_ptrs, v_ptrs, mask_base, offs_m, lo, hi, row_strides, sizes, coefs, rows,
                   SCORE: tl.constexpr, ADAPTIVE: tl.constexpr, CAUSAL: tl.constexpr,
                   MASK_KIND: tl.constexpr, BOUNDARY: tl.constexpr, EVEN_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr,
                   BLOCK_M: tl.constexpr, POLY_EXP2: tl.constexpr, window, dropout_args,
                   WINDOW: tl.constexpr, DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr):
    """Key blocks ``[lo, hi)`` of one query block of the dQ kernel. Grouped inputs:
    ``row_strides = (K, V, mask row, mask column)`` strides, ``sizes = (Lq, Lk, D, DV)``,
    ``coefs = (cb, coef, cap_a)``, the rows' ``rows = (lse2, delta, beta, lse_l2, ent, lse2_lo,
    lse_l2_lo)`` (the last two: the LSEs' residuals, ``lse_residual.py``, ``MASK_KIND == 2`` only),
    ``window = (left, right)``, ``dropout_args = (drop, drop_scale, start_m)``. Accumulates (unscaled):
    ``dq += ds K`` and the parameters' per-row gradient sums ``acc0, acc1`` (``logits.dq_tile_terms``:
    SSA ``ds = dl / u``, ``acc1 = rowsum(dl x)`` (dn), ``acc0 = rowsum(dl t / u)`` (db, ``SOFTCAP``
    only: the cap breaks the identity that gives ``db`` from ``dQ``)); with ADAPTIVE also
    ``dbeta`` (centred: ``rowsum(dl (l2 - lse_l2))``) and the entropy-term sums (``dq_ent``,
    ``ent0``, ``ent1``). With DROPOUT ``dP' = r M (dO V^T)`` (``drop``:
    ``dropout.dropout_state``'s tuple, ``drop_scale = r``, ``start_m`` the first query)."""
    stride_kn, stride_vn, stride_mask_m, stride_mask_n = row_strides
    Lq, Lk, D, DV = sizes
    cb, coef, cap_a = coefs
    lse2, delta, beta, lse_l2, ent, lse2_lo, lse_l2_lo = rows
    win_left, win_right = window
    drop, drop_scale, start_m = dropout_args
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # loaded inline, not through tile_loads.load_rows: with it ptxas gives the softmax dQ kernel
        # one more register on sm_80 (static audit, bench/NOTES.md)
        if BOUNDARY:
            key_ok = offs_n[:, None] < Lk  # audit: boundary-only
            k = tl.load(k_ptrs + start_n * stride_kn, mask=key_ok & (offs_d[None, :] < D), other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vn, mask=key_ok & (offs_dv[None, :] < DV), other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs + start_n * stride_kn)
            v = tl.load(v_ptrs + start_n * stride_vn)
        else:
            k = tl.load(k_ptrs + start_n * stride_kn, mask=offs_d[None, :] < D, other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vn, mask=offs_dv[None, :] < DV, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC)
        x, u, t = tile_logit_input_and_u(s, cb, cap_a, SCORE, SOFTCAP, ACC, FAST_MATH)
        if BOUNDARY or MASK_KIND != 0:
            l2 = boundary_logits(x * coef, offs_m, offs_n, Lq, Lk, mask_base, stride_mask_m,
                                 stride_mask_n, LOG2E, BOUNDARY, CAUSAL, MASK_KIND, False,
                                 win_left, win_right, WINDOW)
            if ADAPTIVE:
                lt = l2 * beta[:, None] - lse2[:, None]
            else:
                lt = l2 - lse2[:, None]
            if MASK_KIND == 2:
                lt = lt - lse2_lo[:, None]
            p = tl.exp2(lt)
        else:
            if ADAPTIVE:
                p = tl.exp2(x * (coef * beta)[:, None] - lse2[:, None])
            else:
                p = tl.exp2(x * coef - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC)
        if DROPOUT:
            keep = tile_keep(drop, start_m, start_n, BLOCK_M, BLOCK_N, False, FAST_MATH)
            dl = p * (tl.where(keep, dp, 0.0) * drop_scale - delta[:, None])
        else:
            dl = p * (dp - delta[:, None])
        if ADAPTIVE:
            if BOUNDARY or MASK_KIND != 0:
                admissible = l2 != float("-inf")
                log_p2 = l2 - lse_l2[:, None]
                if MASK_KIND == 2:
                    log_p2 = log_p2 - lse_l2_lo[:, None]
                log_p2 = tl.where(admissible, log_p2, 0.0)
                dbeta += tl.sum(dl * log_p2, 1)
                ent_term = tl.where(admissible, tl.exp2(log_p2) * (log_p2 * LN2 + ent[:, None]), 0.0)
            else:
                l2 = x * coef
                log_p2 = l2 - lse_l2[:, None]
                dbeta += tl.sum(dl * log_p2, 1)
                ent_term = tl.exp2(log_p2) * (log_p2 * LN2 + ent[:, None])
            dl = dl * beta[:, None]
        ent_term_in = dl
        if ADAPTIVE:
            ent_term_in = ent_term
        ds, ent_ds, acc0, acc1, ent0, ent1 = dq_tile_terms(dl, ent_term_in, x, u, t, acc0, acc1, ent0, ent1, SCORE,
                                                           ADAPTIVE, SOFTCAP, BLOCK_M, BLOCK_N, FAST_MATH, POLY_EXP2)
        if ADAPTIVE:
            dq_ent += tl.dot(ent_ds.to(k.dtype), k, input_precision=DOT_PRECISION, out_dtype=ACC)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION, out_dtype=ACC)
    return dq, dq_ent, acc1, ent1, dbeta, acc0, ent0


@triton.jit
def attention_bwd_dq_kernel(
    Q, K, V, O, DO, DQ, row_stats, temperature, score_params, param_parts, MASK,
    q_strides, k_strides, v_strides, o_strides, do_strides, dq_strides, mask_strides,
    dims, scale, seqlens, dropout, window, sinks, softcap,
    SCORE: tl.constexpr, ADAPTIVE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr,
    POLY_EXP2: tl.constexpr, VARLEN: tl.constexpr = 0,
    G_GIVEN: tl.constexpr = False, DROPOUT: tl.constexpr = False, WINDOW: tl.constexpr = False,
    SINKS: tl.constexpr = False, SOFTCAP: tl.constexpr = False, DBETA_PART: tl.constexpr = False,
):
    """dQ of one query block, with its share of the score function's parameter gradients and
    (adaptive) the temperature terms.
    Grouped arguments as in :func:`~.forward.attention_fwd_kernel`; ``row_stats = (LSE, DLSE,
    DELTA, LSE2, LSE2_LO, LSE_L2_HI, LSE_L2_LO, stat_stride_h)`` the per-row statistics (the
    forward's LSE, the gradient reaching it, delta and the base-2 LSE written here for the dK/dV
    kernel; with ``MASK_KIND == 2`` the recounted ``(hi, lo)`` pairs of ``lse_residual.py``,
    ``LSE2`` being the first's ``hi``, written here, dummies otherwise) and their head stride;
    ``temperature = (BETA, LSE_L, ENT, DBETA_DH, G)`` the adaptive temperature's per-row tensors (dummies without),
    ``score_params = (P0, P1)`` as in the forward, ``param_parts = (DP0_PART, DP1_PART)`` the
    per-program partial sums of their gradients (``logits.store_param_grads``; dummies where
    the score function has fewer parameters),
    ``seqlens = (CU_Q, CU_K)``; ``sinks = (SINK, DSINK_PART)`` the ``(Hq,)`` sink logits and the
    per-program partial sums of their gradient (``SINKS``), ``softcap`` as in the forward.
    ``DBETA_PART``: the keys are a shard of the rows' (:func:`~.launch.row_dbeta`), whose ``dbeta``
    is the shard's centred sum alone."""
    H, Lq, Lk, D, DV, GROUP, num_m_blocks = dims
    LSE, DLSE, DELTA, LSE2, LSE2_LO, LSE_L2_HI, LSE_L2_LO, stat_stride_h = row_stats
    BETA, LSE_L, ENT, DBETA_DH, G = temperature
    DP0_PART, DP1_PART = param_parts

    # where this program's rows lie (extents.py: dense or packed); q, dO, O and dQ share the
    # query rows, K and V the key rows
    (m_block, bh, off_b, off_h, off_kv, batch, q_row0, k_row0, Lq, Lk, _,
     past_end) = query_block_rows(num_m_blocks, H, GROUP, seqlens, Lq, Lk, BLOCK_M, VARLEN)
    if past_end:
        return
    row_base, offs_m, offs_d, row_ok = query_rows(m_block, bh, off_h, q_row0, Lq, stat_stride_h, BLOCK_M, BLOCK_D, VARLEN)
    offs_dv = tl.arange(0, BLOCK_DV)
    qd_ok = row_ok[:, None] & (offs_d[None, :] < D)
    vd_ok = row_ok[:, None] & (offs_dv[None, :] < DV)

    q = tl.load(tile_ptrs(Q, rows_base(q_strides, batch, q_row0), q_strides, off_h, offs_m, offs_d), mask=qd_ok, other=0.0)
    do = tl.load(tile_ptrs(DO, rows_base(do_strides, batch, q_row0), do_strides, off_h, offs_m, offs_dv),
                 mask=vd_ok, other=0.0)
    o = tl.load(tile_ptrs(O, rows_base(o_strides, batch, q_row0), o_strides, off_h, offs_m, offs_dv), mask=vd_ok, other=0.0)
    row_stat = row_base + offs_m
    delta = tl.sum(do.to(ACC) * o.to(ACC), 1)
    dlse = tl.zeros((BLOCK_M,), dtype=ACC)
    if HAS_DLSE:  # d lse_i / d S'_ij = P'_ij: a gradient on the LSE only shifts delta
        dlse = tl.load(DLSE + row_stat, mask=row_ok, other=0.0).to(ACC)
        delta -= dlse
    tl.store(DELTA + row_stat, delta, mask=row_ok)
    lse2 = _masked_lse2(tl.load(LSE + row_stat, mask=row_ok, other=0.0).to(ACC))
    tl.store(LSE2 + row_stat, lse2, mask=row_ok)  # for the dK/dV kernel, ready to use

    scale, cap_a, cap_c = logit_scales(scale, softcap, SOFTCAP, ACC)
    P0, P1 = score_params
    cb, coef, ds_scale = bwd_head_coefficients(P0, P1, off_h, scale, cap_c, SCORE, SOFTCAP, ACC)
    zero_row = tl.zeros((BLOCK_M,), dtype=ACC)
    acc0 = zero_row
    ent0 = zero_row
    acc1 = zero_row
    ent1 = zero_row
    dbeta = zero_row
    beta = zero_row + 1.0
    lse_l2 = zero_row
    ent = zero_row
    if ADAPTIVE:
        beta = tl.load(BETA + row_stat, mask=row_ok, other=1.0).to(ACC)
        lse_l2 = _masked_lse2(tl.load(LSE_L + row_stat, mask=row_ok, other=0.0).to(ACC))
        ent = tl.load(ENT + row_stat, mask=row_ok, other=0.0).to(ACC)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=ACC)
    dq_ent = tl.zeros((BLOCK_M, BLOCK_D), dtype=ACC)

    offs_nb = tl.arange(0, BLOCK_N)
    k_ptrs = tile_ptrs(K, rows_base(k_strides, batch, k_row0), k_strides, off_kv, offs_nb, offs_d)
    v_ptrs = tile_ptrs(V, rows_base(v_strides, batch, k_row0), v_strides, off_kv, offs_nb, offs_dv)
    mask_base = MASK + off_b * mask_strides[0] + off_h * mask_strides[1]
    drop = dropout_stream(dropout, off_b, off_h, DROPOUT)
    drop_scale = dropout_scale(dropout, DROPOUT, ACC)
    win_left, win_right = window_edges(window, WINDOW)
    hi = Lk
    mid = interior_end(0, Lk, BLOCK_N)
    if CAUSAL:
        hi = tl.minimum(Lk, (m_block + 1) * BLOCK_M)
        mid = tl.minimum(mid, ((m_block * BLOCK_M + 1) // BLOCK_N) * BLOCK_N)
    lo = 0
    a = 0
    if WINDOW:
        lo, a, mid, hi = window_key_bounds(m_block * BLOCK_M, hi, mid, win_left, win_right, BLOCK_M, BLOCK_N)
    lse2_lo = zero_row
    lse_l2_lo = zero_row
    if MASK_KIND == 2:  # finite masks can make the LSE too large for float32 to resolve the weights
        if needs_residual(lse2, lse_l2, ADAPTIVE):
            sink_logit = 0.0
            if SINKS:
                sink_logit = tl.load(sinks[0] + off_h).to(ACC)
            m_t, tot_t, m_u, tot_u = row_start_pair(sink_logit, beta, BLOCK_M, ACC, SINKS)
            for STAGE in tl.static_range(3):
                if STAGE != 0 or WINDOW:
                    start, end = stage_range(STAGE, lo, a, mid, hi)
                    m_t, tot_t, m_u, tot_u = row_residual_blocks(
                        m_t, tot_t, m_u, tot_u, q, k_ptrs, mask_base, offs_m, start, end, k_strides[2],
                        mask_strides[2], mask_strides[3], Lq, Lk, D, cb, coef, cap_a, beta, SCORE, ADAPTIVE,
                        CAUSAL, MASK_KIND, STAGE != 1, EVEN_D, BLOCK_N, BLOCK_D, ACC, DOT_PRECISION, FAST_MATH,
                        win_left, win_right, WINDOW, SOFTCAP)
            lse2, lse2_lo = residual(m_t, tot_t, lse2)
            if ADAPTIVE:
                lse_l2, lse_l2_lo = residual(m_u, tot_u, lse_l2)
        tl.store(LSE2 + row_stat, lse2, mask=row_ok)
        tl.store(LSE2_LO + row_stat, lse2_lo, mask=row_ok)
        if ADAPTIVE:
            tl.store(LSE_L2_HI + row_stat, lse_l2, mask=row_ok)
            tl.store(LSE_L2_LO + row_stat, lse_l2_lo, mask=row_ok)
    for STAGE in tl.static_range(3):
        if STAGE != 0 or WINDOW:
            start, end = stage_range(STAGE, lo, a, mid, hi)
            dq, dq_ent, acc1, ent1, dbeta, acc0, ent0 = _dq_key_blocks(
                dq, dq_ent, acc1, ent1, dbeta, acc0, ent0, q, do, k_ptrs, v_ptrs, mask_base, offs_m,
                start, end, (k_strides[2], v_strides[2], mask_strides[2], mask_strides[3]), (Lq, Lk, D, DV),
                (cb, coef, cap_a), (lse2, delta, beta, lse_l2, ent, lse2_lo, lse_l2_lo), SCORE, ADAPTIVE, CAUSAL, MASK_KIND, STAGE != 1,
                EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV, ACC, DOT_PRECISION, FAST_MATH, BLOCK_M,
                POLY_EXP2 if STAGE == 1 else 0, (win_left, win_right), (drop, drop_scale, m_block * BLOCK_M),
                WINDOW, DROPOUT, SOFTCAP)

    if SINKS:
        # The sink is an entry of the row with value 0 (docs/maths.md §6.2): its dS' is
        # -P'_sink delta (dP = 0), and its term of dbeta_i = sum_j dS'_ij l_ij is added here.
        SINK, DSINK_PART = sinks
        sink = tl.load(SINK + off_h).to(ACC)
        p_sink = tl.exp2(sink * LOG2E * beta - lse2 - lse2_lo)
        ds_sink = tl.where(row_ok, -p_sink * delta, 0.0)
        if ADAPTIVE:
            # (centred as the keys' terms; a sink of -inf: no term, where() first, so that no
            # 0 * inf is formed)
            dbeta += ds_sink * tl.where(p_sink > 0.0, sink * LOG2E - lse_l2, 0.0)
    if ADAPTIVE:
        if G_GIVEN:  # the caller holds only some of the keys and gives the whole row's g
            g = tl.load(G + row_stat, mask=row_ok, other=0.0).to(ACC)
        else:
            # dbeta_i = sum_j dS'_ij l_ij, with l2 = l log2(e), from its centred sum (module
            # docstring); a shard of the keys (DBETA_PART) leaves lse^l dlse to its caller
            if HAS_DLSE and not DBETA_PART:
                dbeta += lse_l2 * dlse
            g = dbeta * LN2 * tl.load(DBETA_DH + row_stat, mask=row_ok, other=0.0).to(ACC)
            tl.store(G + row_stat, g, mask=row_ok)
        dq = dq - g[:, None] * dq_ent
        acc1 = acc1 - g * ent1
        acc0 = acc0 - g * ent0
    if SINKS:
        # d s_h = sum_i [beta_i dS'_i,sink - g_i P_i,sink (log P_i,sink + H_i)] (the second term:
        # the entropy path, adaptive only; P_sink temperature-free), one partial sum per program
        dsink = ds_sink * beta
        if ADAPTIVE:
            p_sink_l = tl.exp2(sink * LOG2E - lse_l2 - lse_l2_lo)
            log_p_sink = tl.where(p_sink_l > 0.0, (sink * LOG2E - lse_l2 - lse_l2_lo) * LN2, 0.0)
            dsink -= tl.where(row_ok, g * p_sink_l * (log_p_sink + ent), 0.0)
        tl.store(DSINK_PART + bh * num_m_blocks + m_block, tl.sum(dsink, 0))
    store_param_grads(q, dq, acc0, acc1, P0, P1, DP0_PART, DP1_PART, (bh, num_m_blocks, m_block), off_h, scale,
                      cap_c, SCORE, SOFTCAP, ACC)
    dq = dq * ds_scale
    tl.store(tile_ptrs(DQ, rows_base(dq_strides, batch, q_row0), dq_strides, off_h, offs_m, offs_d),
             dq.to(DQ.dtype.element_ty), mask=qd_ok)


@triton.jit
def _dkdv_query_blocks(dk, dv, k, v, q_ptrs, do_ptrs, mask_base, row_base, offs_n, lo, hi,
                       row_strides, sizes, coefs, row_ptrs,
                       SCORE: tl.constexpr, ADAPTIVE: tl.constexpr, CAUSAL: tl.constexpr,
                       MASK_KIND: tl.constexpr, BOUNDARY: tl.constexpr, EVEN_D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr,
                       BLOCK_N: tl.constexpr, POLY_EXP2: tl.constexpr, window, dropout_args,
                       WINDOW: tl.constexpr, DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr):
    """Query blocks ``[lo, hi)`` of one query head for one key block, on transposed tiles
    (BLOCK_N keys x BLOCK_M queries). Grouped inputs as in :func:`_dq_key_blocks`:
    ``row_strides = (Q, dO, mask row, mask column)`` strides, ``sizes``, ``coefs = (cb, coef,
    ds_scale, cap_a)``, the row statistics' pointers ``row_ptrs = (LSE2, DELTA, BETA, LSE_L, ENT,
    G, LSE2_LO, LSE_L2_HI, LSE_L2_LO)`` (the recounted pairs: ``MASK_KIND == 2`` only), ``window``, ``dropout_args = (drop, drop_scale, start_n)``. Accumulates ``dv += P'^T dO`` and ``dk += ds^T Q`` with
    this head's ``ds_scale`` applied (heads of a GQA group differ in it). With DROPOUT,
    ``dv += (M P')^T dO`` (the ``1 / (1 - p)`` is applied once, at the end) and
    ``dP' = r M (dO V^T)``; ``drop`` is this head's ``dropout.dropout_state`` tuple."""
    stride_qm, stride_dom, stride_mask_m, stride_mask_n = row_strides
    Lq, Lk, D, DV = sizes
    cb, coef, ds_scale, cap_a = coefs
    LSE2, DELTA, BETA, LSE_L, ENT, G, LSE2_LO, LSE_L2_HI, LSE_L2_LO = row_ptrs
    win_left, win_right = window
    drop, drop_scale, start_n = dropout_args
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_stat = row_base + offs_m
        if BOUNDARY:
            row_ok = offs_m < Lq  # audit: boundary-only
            q = tl.load(q_ptrs + start_m * stride_qm, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
            do = tl.load(do_ptrs + start_m * stride_dom, mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            lse2 = tl.load(LSE2 + row_stat, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + row_stat, mask=row_ok, other=0.0)
        else:
            if EVEN_D:
                q = tl.load(q_ptrs + start_m * stride_qm)
                do = tl.load(do_ptrs + start_m * stride_dom)
            else:
                q = tl.load(q_ptrs + start_m * stride_qm, mask=offs_d[None, :] < D, other=0.0)
                do = tl.load(do_ptrs + start_m * stride_dom, mask=offs_dv[None, :] < DV, other=0.0)
            lse2 = tl.load(LSE2 + row_stat)
            delta = tl.load(DELTA + row_stat)
        if MASK_KIND == 2:  # the LSEs' residuals (lse_residual.py)
            lse2_lo = tl.load(LSE2_LO + row_stat, mask=offs_m < Lq, other=0.0)
            if ADAPTIVE:
                lse_l2_lo = tl.load(LSE_L2_LO + row_stat, mask=offs_m < Lq, other=0.0)
        st = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION, out_dtype=ACC)
        x, u, t = tile_logit_input_and_u(st, cb, cap_a, SCORE, SOFTCAP, ACC, FAST_MATH)
        if ADAPTIVE:
            row_ok = offs_m < Lq
            beta = tl.load(BETA + row_stat, mask=row_ok, other=1.0).to(ACC)
            if MASK_KIND == 2:  # the dQ kernel's recount (lse_residual.py)
                lse_l2 = tl.load(LSE_L2_HI + row_stat, mask=row_ok, other=0.0)
            else:
                lse_l2 = _masked_lse2(tl.load(LSE_L + row_stat, mask=row_ok, other=0.0).to(ACC))
            ent = tl.load(ENT + row_stat, mask=row_ok, other=0.0).to(ACC)
            g = tl.load(G + row_stat, mask=row_ok, other=0.0).to(ACC)
            l2 = x * coef
            if BOUNDARY or MASK_KIND != 0:
                l2 = boundary_logits(l2, offs_m, offs_n, Lq, Lk, mask_base, stride_mask_m,
                                     stride_mask_n, LOG2E, BOUNDARY, CAUSAL, MASK_KIND, True,
                                     win_left, win_right, WINDOW)
            lt = l2 * beta[None, :] - lse2[None, :]
            if MASK_KIND == 2:
                lt = lt - lse2_lo[None, :]
            pt = tl.exp2(lt)
        elif BOUNDARY or MASK_KIND != 0:
            l2 = boundary_logits(x * coef, offs_m, offs_n, Lq, Lk, mask_base, stride_mask_m,
                                 stride_mask_n, LOG2E, BOUNDARY, CAUSAL, MASK_KIND, True,
                                 win_left, win_right, WINDOW)
            lt = l2 - lse2[None, :]
            if MASK_KIND == 2:
                lt = lt - lse2_lo[None, :]
            pt = tl.exp2(lt)
        else:
            pt = tl.exp2(x * coef - lse2[None, :])
        if DROPOUT:
            keep = tile_keep(drop, start_m, start_n, BLOCK_M, BLOCK_N, True, FAST_MATH)
            dv += tl.dot(tl.where(keep, pt, 0.0).to(do.dtype), do, input_precision=DOT_PRECISION, out_dtype=ACC)
            dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=ACC)
            dpt = tl.where(keep, dpt, 0.0)  # times drop_scale, folded below
        else:
            dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION, out_dtype=ACC)
            dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=ACC)
        if ADAPTIVE:
            if BOUNDARY or MASK_KIND != 0:
                admissible = l2 != float("-inf")
                log_p2 = l2 - lse_l2[None, :]
                if MASK_KIND == 2:
                    log_p2 = log_p2 - lse_l2_lo[None, :]
                log_p2 = tl.where(admissible, log_p2, 0.0)
                ent_term = tl.where(admissible, tl.exp2(log_p2) * (log_p2 * LN2 + ent[None, :]), 0.0)
            else:
                log_p2 = l2 - lse_l2[None, :]
                ent_term = tl.exp2(log_p2) * (log_p2 * LN2 + ent[None, :])
            if DROPOUT:
                dl = pt * (dpt * drop_scale - delta[None, :]) * beta[None, :] - g[None, :] * ent_term
            else:
                dl = pt * (dpt - delta[None, :]) * beta[None, :] - g[None, :] * ent_term
            ds = dl * ds_scale
        elif SCORE != SOFTMAX_ID:  # dl/ds's per-head factor depends on the head's parameters (logits.py)
            # ds_scale folded into the subtraction: one multiply-add instead of an add
            if DROPOUT:
                ds = pt * (dpt * (ds_scale * drop_scale) - (delta * ds_scale)[None, :])
            else:
                ds = pt * (dpt * ds_scale - (delta * ds_scale)[None, :])
        else:
            if DROPOUT:
                ds = pt * (dpt * drop_scale - delta[None, :])
            else:
                ds = pt * (dpt - delta[None, :])  # times scale, once, at the end
        ds = dscore_factor(ds, u, x, t, SCORE, SOFTCAP, BLOCK_N, BLOCK_M, FAST_MATH, POLY_EXP2)
        dk += tl.dot(ds.to(q.dtype), q, input_precision=DOT_PRECISION, out_dtype=ACC)
    return dk, dv


@triton.jit
def attention_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV_OUT, row_stats, temperature, score_params, MASK,
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides, mask_strides,
    dims, scale, seqlens, dropout, window, softcap,
    SCORE: tl.constexpr, ADAPTIVE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr,
    POLY_EXP2: tl.constexpr, VARLEN: tl.constexpr = 0, DROPOUT: tl.constexpr = False, WINDOW: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    """dK and dV of one key block (of one key/value head, over the query heads of its group).
    Grouped arguments as in :func:`attention_bwd_dq_kernel`; ``dims = (H, HKV, Lq, Lk, D, DV,
    GROUP, num_n_blocks)`` (key/value heads too, key blocks per (batch, key/value head));
    ``row_stats = (LSE2, DELTA, LSE2_LO, LSE_L2_HI, LSE_L2_LO, stat_stride_h)`` (the recounted
    pairs: ``MASK_KIND == 2`` only, else dummies); ``temperature = (BETA, LSE_L, ENT, G)``."""
    H, HKV, Lq, Lk, D, DV, GROUP, num_n_blocks = dims
    LSE2, DELTA, LSE2_LO, LSE_L2_HI, LSE_L2_LO, stat_stride_h = row_stats
    BETA, LSE_L, ENT, G = temperature

    # where this program's rows lie (extents.py: dense or packed)
    start_n, off_b, off_kv, batch, q_row0, k_row0, Lq, Lk, past_end = key_block_rows(
        num_n_blocks, HKV, seqlens, Lq, Lk, BLOCK_N, VARLEN)
    if past_end:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < Lk
    kd_ok = col_ok[:, None] & (offs_d[None, :] < D)
    vd_ok = col_ok[:, None] & (offs_dv[None, :] < DV)
    k_base = rows_base(k_strides, batch, k_row0)
    v_base = rows_base(v_strides, batch, k_row0)
    k = tl.load(tile_ptrs(K, k_base, k_strides, off_kv, offs_n, offs_d), mask=kd_ok, other=0.0)
    v = tl.load(tile_ptrs(V, v_base, v_strides, off_kv, offs_n, offs_dv), mask=vd_ok, other=0.0)
    scale, cap_a, cap_c = logit_scales(scale, softcap, SOFTCAP, ACC)
    P0, P1 = score_params

    # Query blocks: [lo, diag_end) boundary (causal diagonal), [diag_end, int_end) interior,
    # [int_end, Lq) boundary (ragged end). A ragged key block makes every tile a boundary one.
    lo = 0
    diag_end = 0
    if CAUSAL:  # queries before this key block never see it
        lo = (start_n // BLOCK_M) * BLOCK_M
        diag_end = lo + tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - lo, 0), BLOCK_M) * BLOCK_M
    if start_n + BLOCK_N > Lk:
        diag_end = tl.cdiv(Lq, BLOCK_M) * BLOCK_M
    int_end = interior_end(diag_end, tl.maximum(Lq, diag_end), BLOCK_M)
    hi = Lq
    win_left, win_right = window_edges(window, WINDOW)
    if WINDOW:
        lo, diag_end, int_end, hi = window_query_bounds(start_n, lo, diag_end, int_end, Lq, win_left,
                                                        win_right, BLOCK_M, BLOCK_N)
    drop_scale = dropout_scale(dropout, DROPOUT, ACC)

    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=ACC)
    offs_mb = tl.arange(0, BLOCK_M)
    for g_idx in range(0, GROUP):
        off_h = off_kv * GROUP + g_idx
        row_base = row_stat_base(off_b * H + off_h, off_h, q_row0, Lq, stat_stride_h, VARLEN)
        cb, coef, ds_scale = bwd_head_coefficients(P0, P1, off_h, scale, cap_c, SCORE, SOFTCAP, ACC)
        q_ptrs = tile_ptrs(Q, rows_base(q_strides, batch, q_row0), q_strides, off_h, offs_mb, offs_d)
        do_ptrs = tile_ptrs(DO, rows_base(do_strides, batch, q_row0), do_strides, off_h, offs_mb, offs_dv)
        mask_base = MASK + off_b * mask_strides[0] + off_h * mask_strides[1]
        drop = dropout_stream(dropout, off_b, off_h, DROPOUT)
        for STAGE in tl.static_range(3):
            start, end = stage_range(STAGE, lo, diag_end, int_end, hi)
            if STAGE == 0:  # a ragged key block's boundary stage runs to cdiv(Lq, BLOCK_M) blocks
                end = tl.minimum(end, hi)
            dk, dv = _dkdv_query_blocks(
                dk, dv, k, v, q_ptrs, do_ptrs, mask_base, row_base, offs_n, start, end,
                (q_strides[2], do_strides[2], mask_strides[2], mask_strides[3]), (Lq, Lk, D, DV),
                (cb, coef, ds_scale, cap_a), (LSE2, DELTA, BETA, LSE_L, ENT, G, LSE2_LO, LSE_L2_HI, LSE_L2_LO), SCORE, ADAPTIVE, CAUSAL, MASK_KIND,
                STAGE != 1, EVEN_D, BLOCK_M, BLOCK_D, BLOCK_DV, ACC, DOT_PRECISION, FAST_MATH, BLOCK_N,
                POLY_EXP2 if STAGE == 1 else 0, (win_left, win_right), (drop, drop_scale, start_n),
                WINDOW, DROPOUT, SOFTCAP)

    if SCORE == SOFTMAX_ID and not ADAPTIVE:  # softmax's dl/ds factor: the scale alone, once per dK
        dk = dk * scale
    if DROPOUT:
        dv = dv * drop_scale
    tl.store(tile_ptrs(DK, rows_base(dk_strides, batch, k_row0), dk_strides, off_kv, offs_n, offs_d),
             dk.to(DK.dtype.element_ty), mask=kd_ok)
    tl.store(tile_ptrs(DV_OUT, rows_base(dv_strides, batch, k_row0), dv_strides, off_kv, offs_n, offs_dv),
             dv.to(DV_OUT.dtype.element_ty), mask=vd_ok)
