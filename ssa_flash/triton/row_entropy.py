"""Statistics pass: per-row entropy and log-sum-exp of ``softmax(l)``, streamed over keys (QK^T
only, no V), for the adaptive temperature and for ``attention_entropy``.

Per row it keeps the running max ``m``, ``lam = sum exp(l - m)`` and the centred
``kc = sum exp(l - m) * (l - m)``; then ``H = log(lam) - kc / lam`` and ``lse = m + log(lam)``.
This equals the paper's ``H = m + log(Lam) - K / Lam`` with ``K = sum exp(l - m) l``, without the
cancellation between ``m`` and ``K / Lam`` when logits are large. In base-2 units when ``m``
grows to ``m'``, with ``a = 2^(m - m')``: ``lam' = a lam``, ``kc' = a (kc + lam (m - m'))``.
Interior key blocks first, then boundary ones, as in the forward (under ``WINDOW``, boundary
blocks cut by the window's left edge first); the same ``VARLEN`` layouts and ``SPLIT`` (partial
``(entropy, lse)`` per split, merged in ``splitkv.py``). Dropout does not enter: it acts on the
final weights, after the temperature that these statistics decide. ``SOFTCAP`` caps the scores
(``logits.py``); with ``SINKS`` each row starts from its sink logit ``m = s_h``, ``lam = 1``,
``kc = 0`` (``logits.row_start``): the sink is an entry of the row (docs/maths.md §6.2).
"""
import triton
import triton.language as tl

from .extents import query_block_rows, query_key_ranges, query_rows, rows_base, stage_range, tile_ptrs
from .logits import LN2, LOG2E, head_coefficients, row_start, safe_row_max, tile_logit_input
from .masks import boundary_logits
from .prologue import logit_scales, signed_query_tile, window_edges
from .tile_loads import load_rows


@triton.jit
def _row_entropy_key_blocks(m_i, lam, kc, q, k_ptrs, mask_base, offs_m, lo, hi,
                      stride_kn, stride_mask_m, stride_mask_n, Lq, Lk, D, cb, coef, cap_a,
                      SCORE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                      BOUNDARY: tl.constexpr, EVEN_D: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr,
                      win_left, win_right, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_rows(k_ptrs, start_n, stride_kn, offs_n, Lk, D, BLOCK_D, BOUNDARY, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC)
        x = tile_logit_input(s, cb, cap_a, SCORE, SOFTCAP, ACC, FAST_MATH)
        if BOUNDARY or MASK_KIND != 0:
            l2 = boundary_logits(x * coef, offs_m, offs_n, Lq, Lk, mask_base,
                                 stride_mask_m, stride_mask_n, LOG2E, BOUNDARY, CAUSAL, MASK_KIND, False,
                                 win_left, win_right, WINDOW)
            m_new = tl.maximum(m_i, tl.max(l2, 1))
            m_safe = safe_row_max(m_new)
            shift = tl.where(m_i == float("-inf"), 0.0, m_i - m_safe)  # lam is 0 while m_i is -inf
            centred = tl.where(l2 == float("-inf"), 0.0, l2 - m_safe[:, None])
            p = tl.where(l2 == float("-inf"), 0.0, tl.exp2(centred))
        else:
            m_new = tl.maximum(m_i, tl.max(x, 1) * coef)
            shift = tl.where(m_i == float("-inf"), 0.0, m_i - m_new)
            centred = x * coef - m_new[:, None]
            p = tl.exp2(centred)
        alpha = tl.exp2(shift)
        kc = alpha * (kc + lam * shift) + tl.sum(p * centred, 1)
        lam = lam * alpha + tl.sum(p, 1)
        m_i = m_new
    return m_i, lam, kc


@triton.jit
def row_entropy_kernel(
    Q, K, ENT, LSE, score_params, MASK, q_strides, k_strides, mask_strides,
    dims, scale, seqlens, stat_stride_h, stat_stride_s, window, sinks, softcap,
    SCORE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr,
    VARLEN: tl.constexpr = 0, SPLIT: tl.constexpr = False, WINDOW: tl.constexpr = False,
    SINKS: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    """Entropy and LSE of one query block's rows (module docstring); the grouped arguments as in
    :func:`~.forward.attention_fwd_kernel`, ``dims = (H, Lq, Lk, D, GROUP, num_m_blocks)`` (no
    value head dim), ``stat_stride_s``: between split slots; ``sinks``, ``softcap`` likewise."""
    H, Lq, Lk, D, GROUP, num_m_blocks = dims
    # where this program's rows lie (extents.py), as in the forward kernel
    (m_block, bh, off_b, off_h, off_kv, batch, q_row0, k_row0, Lq, Lk, q_shift,
     past_end) = query_block_rows(num_m_blocks, H, GROUP, seqlens, Lq, Lk, BLOCK_M, VARLEN)
    if past_end:
        return
    row_base, offs_m, offs_d, row_ok = query_rows(m_block, bh, off_h, q_row0, Lq, stat_stride_h, BLOCK_M, BLOCK_D, VARLEN)
    scale, cap_a, cap_c = logit_scales(scale, softcap, SOFTCAP, ACC)
    P0, P1 = score_params
    cb, coef, q_sign = head_coefficients(P0, P1, off_h, scale, cap_c, SCORE, SOFTCAP, ACC)
    q = signed_query_tile(Q, rows_base(q_strides, batch, q_row0), q_strides, off_h, offs_m, offs_d, row_ok, D, q_sign)
    k_ptrs = tile_ptrs(K, rows_base(k_strides, batch, k_row0), k_strides, off_kv, tl.arange(0, BLOCK_N), offs_d)
    mask_base = MASK + off_b * mask_strides[0] + off_h * mask_strides[1]

    sink_l2 = tl.zeros((BLOCK_M,), dtype=ACC)
    if SINKS:  # the sink is an entry of the row whose entropy this is (temperature-free)
        sink_l2 += tl.load(sinks + off_h).to(ACC) * LOG2E
        if SPLIT:  # split 0 holds it, so that the merge counts it once
            sink_l2 = tl.where(tl.program_id(1) == 0, sink_l2, float("-inf"))
    m_i, lam = row_start(BLOCK_M, ACC, sink_l2, SINKS)
    kc = tl.zeros((BLOCK_M,), dtype=ACC)
    # positions the loops compare (bottom-right for a KV cache), as in the forward kernel
    win_left, win_right = window_edges(window, WINDOW)
    pos_m, pos_end, lo, a, mid, hi = query_key_ranges(m_block * BLOCK_M, offs_m, Lq, Lk, q_shift, win_left, win_right,
                                                      CAUSAL, WINDOW, SPLIT, BLOCK_M, BLOCK_N)
    row_out = row_base
    if SPLIT:
        row_out += tl.program_id(1).to(tl.int64) * stat_stride_s
    for STAGE in tl.static_range(3):
        if STAGE != 0 or WINDOW:
            start, end = stage_range(STAGE, lo, a, mid, hi)
            m_i, lam, kc = _row_entropy_key_blocks(
                m_i, lam, kc, q, k_ptrs, mask_base, pos_m, start, end, k_strides[2], mask_strides[2], mask_strides[3],
                pos_end, Lk, D, cb, coef, cap_a, SCORE, CAUSAL, MASK_KIND, STAGE != 1, EVEN_D, BLOCK_N, BLOCK_D, ACC,
                DOT_PRECISION, FAST_MATH, win_left, win_right, WINDOW, SOFTCAP)

    empty = lam == 0.0
    safe_lam = tl.where(empty, 1.0, lam)
    ent = tl.where(empty, 0.0, (tl.log2(safe_lam) - kc / safe_lam) * LN2)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(safe_lam)) * LN2)
    tl.store(ENT + row_out + offs_m, ent, mask=row_ok)
    tl.store(LSE + row_out + offs_m, lse, mask=row_ok)
