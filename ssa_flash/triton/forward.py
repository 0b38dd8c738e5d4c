"""Forward kernel: FlashAttention-2 style streaming over keys with online rescaling on the logit
row ``l2`` (softmax or SSA log-weights, optionally multiplied by a per-row temperature ``beta``).

One program handles BLOCK_M queries of one (batch, query head). It writes the output and the
natural-log row log-sum-exp ``lse`` (of ``beta * l``), which is all the backward needs.
"""
import triton
import triton.language as tl

from .common import LN2, combine_scale, logit_tile, safe_row_max


@triton.jit
def attention_fwd_kernel(
    Q, K, V, O, LSE, BETA, B_SSA, N_SSA, MASK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    H, Lq, Lk, D, DV, GROUP, num_m_blocks, scale_hi, scale_lo,
    SSA: tl.constexpr, ADAPTIVE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    # Heaviest (last, under CAUSAL) query blocks first; consecutive programs share K/V in L2.
    m_block = num_m_blocks - 1 - pid % num_m_blocks
    bh = (pid // num_m_blocks).to(tl.int64)
    off_b = bh // H
    off_h = bh % H
    off_kv = off_h // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Lq

    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    k_base = K + off_b * stride_kb + off_kv * stride_kh
    v_base = V + off_b * stride_vb + off_kv * stride_vh
    mask_base = MASK + off_b * stride_mask_b + off_h * stride_mask_h

    scale = combine_scale(scale_hi, scale_lo, ACC)
    b = 0.0
    n = 0.0
    if SSA:
        b = tl.load(B_SSA + off_h).to(ACC)
        n = tl.load(N_SSA + off_h).to(ACC)
    if ADAPTIVE:
        beta = tl.load(BETA + bh * Lq + offs_m, mask=row_ok, other=1.0).to(ACC)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=ACC)
    l_i = tl.zeros((BLOCK_M,), dtype=ACC)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=ACC)

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
        if ADAPTIVE:
            l2 = l2 * beta[:, None]
        m_new = tl.maximum(m_i, tl.max(l2, 1))
        m_safe = safe_row_max(m_new)
        p = tl.exp2(l2 - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(ACC)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + bh * Lq + offs_m, lse, mask=row_ok)
