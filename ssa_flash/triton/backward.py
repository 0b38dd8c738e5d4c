"""Backward kernels (DESIGN.md 1.2 and 1.3), in two launches with no atomics:

1. ``attention_bwd_dq_kernel``, one program per query block: ``delta = rowsum(dO * O) - dlse``, ``dQ``, the
   per-row temperature gradient ``g`` (adaptive) and per-block partial sums of ``db``, ``dn`` (SSA).
2. ``attention_bwd_dkdv_kernel``, one program per key block of a key/value head: ``dK``, ``dV``,
   summing over the query heads of its GQA group in registers.

Notation per tile, with ``S' = beta * l`` and ``P' = softmax(S')`` the output weights:

    dS'  = P' * (dO V^T - delta)                        (FlashAttention-2's dS, on S')
    dl   = beta * dS' - g * P * (log P + H)              (g = 0 and beta = 1 without ADAPTIVE)
    dz   = dl * phi'(z),  phi'(z) = n b / (1 + b|z|)     (dz = dl for softmax)
    dQ   = scale * dz K,   dK = scale * dz^T Q,   dV = P'^T dO
    db   = sum dl * n z / (1 + b|z|),   dn = sum dl * sgn(z) log1p(b|z|)

``g_i = dbeta_i * dbeta/dH_i`` needs ``dbeta_i = sum_j dS'_ij l_ij`` over the whole row before any
``dl`` is known. Kernel 1 owns whole rows, so it accumulates the ``beta dS'`` part and the
``P (log P + H)`` part of every row-sum separately and combines them with ``g`` at the end;
kernel 2 then reads ``g``. The ``db``/``dn`` partials are reduced in a fixed order afterwards,
so the backward is deterministic.
"""
import triton
import triton.language as tl

from .common import LN2, LOG2E, combine_scale, logit_tile, safe_row_max


@triton.jit
def _masked_lse2(lse):
    """Natural-log LSE to base 2; ``-inf`` (empty row) becomes 0 so that ``exp2(-inf - lse)`` is 0."""
    return safe_row_max(lse * LOG2E)


@triton.jit
def attention_bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DLSE, DQ, DELTA,
    BETA, LSE_L, ENT, DBETA_DH, G,
    B_SSA, N_SSA, DB_PART, DN_PART, MASK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    H, Lq, Lk, D, DV, GROUP, num_m_blocks, scale_hi, scale_lo,
    SSA: tl.constexpr, ADAPTIVE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    m_block = num_m_blocks - 1 - pid % num_m_blocks
    bh = (pid // num_m_blocks).to(tl.int64)
    off_b = bh // H
    off_h = bh % H
    off_kv = off_h // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Lq
    qd_ok = row_ok[:, None] & (offs_d[None, :] < D)
    vd_ok = row_ok[:, None] & (offs_dv[None, :] < DV)

    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=qd_ok, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=vd_ok, other=0.0)
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
                mask=vd_ok, other=0.0)
    row_stat = bh * Lq + offs_m
    delta = tl.sum(do.to(ACC) * o.to(ACC), 1)
    if HAS_DLSE:  # d lse_i / d S'_ij = P'_ij: a gradient on the LSE only shifts delta
        delta -= tl.load(DLSE + row_stat, mask=row_ok, other=0.0).to(ACC)
    tl.store(DELTA + row_stat, delta, mask=row_ok)
    lse2 = _masked_lse2(tl.load(LSE + row_stat, mask=row_ok, other=0.0).to(ACC))

    scale = combine_scale(scale_hi, scale_lo, ACC)
    b = 0.0
    n = 0.0
    if SSA:
        b = tl.load(B_SSA + off_h).to(ACC)
        n = tl.load(N_SSA + off_h).to(ACC)
        db_acc = tl.zeros((BLOCK_M,), dtype=ACC)
        dn_acc = tl.zeros((BLOCK_M,), dtype=ACC)
    if ADAPTIVE:
        beta = tl.load(BETA + row_stat, mask=row_ok, other=1.0).to(ACC)
        lse_l2 = _masked_lse2(tl.load(LSE_L + row_stat, mask=row_ok, other=0.0).to(ACC))
        ent = tl.load(ENT + row_stat, mask=row_ok, other=0.0).to(ACC)
        dbeta = tl.zeros((BLOCK_M,), dtype=ACC)
        dq_ent = tl.zeros((BLOCK_M, BLOCK_D), dtype=ACC)
        if SSA:
            db_ent = tl.zeros((BLOCK_M,), dtype=ACC)
            dn_ent = tl.zeros((BLOCK_M,), dtype=ACC)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=ACC)

    k_base = K + off_b * stride_kb + off_kv * stride_kh
    v_base = V + off_b * stride_vb + off_kv * stride_vh
    mask_base = MASK + off_b * stride_mask_b + off_h * stride_mask_h
    hi = Lk
    if CAUSAL:
        hi = tl.minimum(Lk, (m_block + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < Lk
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=col_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        z, phi2, l2 = logit_tile(q, k, offs_m, offs_n, Lq, Lk, scale, b, n,
                                 mask_base, stride_mask_m, stride_mask_n,
                                 SSA, CAUSAL, MASK_KIND, DOT_PRECISION)
        s2 = l2
        if ADAPTIVE:
            s2 = l2 * beta[:, None]
        p = tl.exp2(s2 - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION).to(ACC)
        dl = p * (dp - delta[:, None])
        if ADAPTIVE:
            admissible = l2 != float("-inf")
            dbeta += tl.sum(dl * tl.where(admissible, l2 * LN2, 0.0), 1)
            dl = dl * beta[:, None]
            # P * (log P + H) of the temperature-free weights P = softmax(l)
            log_p2 = tl.where(admissible, l2 - lse_l2[:, None], 0.0)
            ent_term = tl.where(admissible, tl.exp2(log_p2) * (log_p2 * LN2 + ent[:, None]), 0.0)
        if SSA:
            u = 1.0 + b * tl.abs(z)
            dphi_dz = n * b / u
            db_acc += tl.sum(dl * (n * z / u), 1)
            dn_acc += tl.sum(dl * (phi2 * LN2 / n), 1)
            dz = dl * dphi_dz
            if ADAPTIVE:
                db_ent += tl.sum(ent_term * (n * z / u), 1)
                dn_ent += tl.sum(ent_term * (phi2 * LN2 / n), 1)
                dq_ent += tl.dot((ent_term * dphi_dz).to(k.dtype), k, input_precision=DOT_PRECISION).to(ACC)
        else:
            dz = dl
            if ADAPTIVE:
                dq_ent += tl.dot(ent_term.to(k.dtype), k, input_precision=DOT_PRECISION).to(ACC)
        dq += tl.dot(dz.to(k.dtype), k, input_precision=DOT_PRECISION).to(ACC)

    if ADAPTIVE:
        g = dbeta * tl.load(DBETA_DH + row_stat, mask=row_ok, other=0.0).to(ACC)
        tl.store(G + row_stat, g, mask=row_ok)
        dq = dq - g[:, None] * dq_ent
        if SSA:
            db_acc = db_acc - g * db_ent
            dn_acc = dn_acc - g * dn_ent
    if SSA:
        tl.store(DB_PART + bh * num_m_blocks + m_block, tl.sum(db_acc, 0))
        tl.store(DN_PART + bh * num_m_blocks + m_block, tl.sum(dn_acc, 0))
    dq = dq * scale
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=qd_ok)


@triton.jit
def attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_OUT,
    BETA, LSE_L, ENT, G,
    B_SSA, N_SSA, MASK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    H, HKV, Lq, Lk, D, DV, GROUP, num_n_blocks, scale_hi, scale_lo,
    SSA: tl.constexpr, ADAPTIVE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    n_block = pid % num_n_blocks
    bhkv = (pid // num_n_blocks).to(tl.int64)
    off_b = bhkv // HKV
    off_kv = bhkv % HKV

    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < Lk
    kd_ok = col_ok[:, None] & (offs_d[None, :] < D)
    vd_ok = col_ok[:, None] & (offs_dv[None, :] < DV)
    k = tl.load(K + off_b * stride_kb + off_kv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kd_ok, other=0.0)
    v = tl.load(V + off_b * stride_vb + off_kv * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=vd_ok, other=0.0)
    scale = combine_scale(scale_hi, scale_lo, ACC)

    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=ACC)
    # Under CAUSAL, queries before this key block never see it.
    lo = 0
    if CAUSAL:
        lo = (n_block * BLOCK_N // BLOCK_M) * BLOCK_M
    for g_idx in range(0, GROUP):
        off_h = off_kv * GROUP + g_idx
        bh = off_b * H + off_h
        b = 0.0
        n = 0.0
        if SSA:
            b = tl.load(B_SSA + off_h).to(ACC)
            n = tl.load(N_SSA + off_h).to(ACC)
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_dob + off_h * stride_doh
        mask_base = MASK + off_b * stride_mask_b + off_h * stride_mask_h
        for start_m in range(lo, Lq, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < Lq
            q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                        mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                         mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            row_stat = bh * Lq + offs_m
            lse2 = _masked_lse2(tl.load(LSE + row_stat, mask=row_ok, other=0.0).to(ACC))
            delta = tl.load(DELTA + row_stat, mask=row_ok, other=0.0).to(ACC)
            z, phi2, l2 = logit_tile(q, k, offs_m, offs_n, Lq, Lk, scale, b, n,
                                     mask_base, stride_mask_m, stride_mask_n,
                                     SSA, CAUSAL, MASK_KIND, DOT_PRECISION)
            s2 = l2
            if ADAPTIVE:
                beta = tl.load(BETA + row_stat, mask=row_ok, other=1.0).to(ACC)
                s2 = l2 * beta[:, None]
            p = tl.exp2(s2 - lse2[:, None])
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION).to(ACC)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION).to(ACC)
            dl = p * (dp - delta[:, None])
            if ADAPTIVE:
                admissible = l2 != float("-inf")
                lse_l2 = _masked_lse2(tl.load(LSE_L + row_stat, mask=row_ok, other=0.0).to(ACC))
                ent = tl.load(ENT + row_stat, mask=row_ok, other=0.0).to(ACC)
                g = tl.load(G + row_stat, mask=row_ok, other=0.0).to(ACC)
                log_p2 = tl.where(admissible, l2 - lse_l2[:, None], 0.0)
                ent_term = tl.where(admissible, tl.exp2(log_p2) * (log_p2 * LN2 + ent[:, None]), 0.0)
                dl = dl * beta[:, None] - g[:, None] * ent_term
            if SSA:
                dl = dl * (n * b / (1.0 + b * tl.abs(z)))
            dk += tl.dot(tl.trans(dl.to(q.dtype)), q, input_precision=DOT_PRECISION).to(ACC)

    dk = dk * scale
    tl.store(DK + off_b * stride_dkb + off_kv * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=kd_ok)
    tl.store(DV_OUT + off_b * stride_dvb + off_kv * stride_dvh + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd,
             dv.to(DV_OUT.dtype.element_ty), mask=vd_ok)
