"""Forward kernel: FlashAttention-2 style streaming over keys with online rescaling on the logit
row ``l2`` (the score function's logits, ``logits.py``, optionally multiplied by a per-row
temperature ``beta``).

One program handles BLOCK_M queries of one (batch element or packed sequence, query head), or
with ``SPLIT`` (split-KV decoding) a share of their keys (``VARLEN``: see ``extents.py``). It
writes the output and the natural-log row log-sum-exp ``lse`` (of ``beta * l``), which is all the
backward needs. The key
loop runs first over the interior key blocks (no index checks), then over the boundary ones
(the ragged end, the causal diagonal); under ``WINDOW`` boundary blocks cut by the window's left
edge come first; see ``extents.py`` and ``masks.py``.

With ``DROPOUT`` the weights that multiply V are those kept by the dropout mask, and the output is
scaled by ``1 / (1 - p)``; the running sum ``l_i`` (hence the LSE) is that of the undropped row.

``SOFTCAP`` caps the scores (``logits.py``); ``SINKS`` starts each row from its sink logit
(``logits.row_start``), so the LSE includes the sink and a row with no admissible key gets output 0
and ``lse = s_h``. The sink is not dropped (its value vector is 0).
"""
import triton
import triton.language as tl

from .dropout import tile_keep
from .extents import query_block_rows, query_key_ranges, query_rows, rows_base, stage_range, tile_ptrs
from .fast_math import exp2_half_poly
from .logits import LN2, LOG2E, head_coefficients, row_start, safe_row_max, tile_logit_input
from .masks import boundary_logits
from .prologue import dropout_scale, dropout_stream, logit_scales, signed_query_tile, window_edges
from .tile_loads import load_block, row_descriptor


@triton.jit
def _fwd_key_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_base, offs_m, lo, hi,
                    stride_kn, stride_vn, stride_mask_m, stride_mask_n,
                    Lq, Lk, D, DV, cb, coef, mask_scale, cap_a,
                    SCORE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                    BOUNDARY: tl.constexpr, EVEN_D: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr,
                    BLOCK_M: tl.constexpr, POLY_EXP2: tl.constexpr,
                    win_left, win_right, drop, start_m, WINDOW: tl.constexpr, DROPOUT: tl.constexpr,
                    SOFTCAP: tl.constexpr, k_desc, v_desc, WS: tl.constexpr):
    """Key blocks ``[lo, hi)`` of one query block: updates and returns ``(acc, l_i, m_i)``.
    ``coef`` is per row (``(BLOCK_M,)``); ``m_i`` is the running max of base-2 logits. ``drop``
    is :func:`~.dropout.dropout_state`'s tuple and ``start_m`` the first query (unused without
    DROPOUT). ``WS``: K and V through the tensor descriptors ``k_desc``, ``v_desc`` (``(BLOCK_N,
    BLOCK_D)`` / ``(BLOCK_N, BLOCK_DV)`` tiles at row ``start_n``) and the loop warp-specialised by
    Triton (a TMA producer warpgroup, two consumer warpgroups of 64 query rows each)."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_block(k_desc, k_ptrs, start_n, stride_kn, offs_n, Lk, D, BLOCK_D, BOUNDARY, EVEN_D, WS)
        v = load_block(v_desc, v_ptrs, start_n, stride_vn, offs_n, Lk, DV, BLOCK_DV, BOUNDARY, EVEN_D, WS)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC)
        x = tile_logit_input(s, cb, cap_a, SCORE, SOFTCAP, ACC, FAST_MATH)
        if BOUNDARY or MASK_KIND != 0:
            l2 = boundary_logits(x * coef[:, None], offs_m, offs_n, Lq, Lk, mask_base,
                                 stride_mask_m, stride_mask_n, mask_scale[:, None],
                                 BOUNDARY, CAUSAL, MASK_KIND, False, win_left, win_right, WINDOW)
            m_new = tl.maximum(m_i, tl.max(l2, 1))
            m_safe = safe_row_max(m_new)
            p = tl.exp2(l2 - m_safe[:, None])
        else:
            # coef >= 0: the row max of x * coef is coef times the row max of x, and the
            # logit and its shift fuse into one multiply-add per element.
            m_new = tl.maximum(m_i, tl.max(x, 1) * coef)
            m_safe = m_new  # finite: every element of an interior tile is admissible
            p = exp2_half_poly(x * coef[:, None] - m_safe[:, None], BLOCK_M, BLOCK_N, POLY_EXP2)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(tile_keep(drop, start_m, start_n, BLOCK_M, BLOCK_N, False, FAST_MATH), p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=ACC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attention_fwd_kernel(
    Q, K, V, O, LSE, BETA, score_params, MASK,
    q_strides, k_strides, v_strides, o_strides, mask_strides,
    dims, scale, seqlens, stat_stride_h, split_strides, dropout, window, sinks, softcap,
    SCORE: tl.constexpr, ADAPTIVE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr,
    POLY_EXP2: tl.constexpr = 0, VARLEN: tl.constexpr = 0, SPLIT: tl.constexpr = False,
    DROPOUT: tl.constexpr = False, WINDOW: tl.constexpr = False,
    SINKS: tl.constexpr = False, SOFTCAP: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False,
    WS_FULL_BLOCKS: tl.constexpr = False,
):
    """Output and LSE of one query block (module docstring). Grouped arguments (tuples):
    ``dims = (H, Lq, Lk, D, DV, GROUP, num_m_blocks)`` the problem's sizes (query heads, lengths,
    head dims, query heads per key/value head) and the query blocks per (batch, head);
    ``score_params = (P0, P1)`` the score function's per-head parameters ``(Hq,)`` in registry
order (dummies where it has fewer; ``SCORE``: its registry id, ``logits.py``); each
    ``*_strides`` a 4-D tensor's ``(batch, head, row, column)`` strides; ``scale = (hi, lo)``, the
    softmax scale as float32 head + remainder; ``seqlens = (CU_Q, CU_K, SEQUSED_K)`` (extents.py);
    ``split_strides = (output, statistics)`` strides between split slots (``SPLIT``). Dropout:
    ``dropout = (RNG, keep31, drop_scale_hi, drop_scale_lo)`` with ``RNG`` the ``(seed, offset)``
    int64 tensor, ``keep31 = round((1 - p) 2^31)``, ``drop_scale = 1 / (1 - p)`` split as the
    softmax scale is; None without. Window: ``window = (left, right)``, both >= 0 (an unbounded
    side: at least the sequence length), in the query positions the loops see (bottom-right for a
    KV cache); None without. ``sinks``: the ``(Hq,)`` sink logits (``SINKS``; with ``SPLIT`` split
    0 holds the sink, so that the merge counts it once); ``softcap = (hi, lo)``, the cap ``c``
    split as the scale is (``SOFTCAP``); None without.

    ``WARP_SPECIALIZE`` (sm_90, Triton >= 3.6; the launcher offers it for dense layouts, 16-bit
    inputs, ``D = DV`` in {64, 128}, no mask, dropout, window, sinks or cap): Q, K, V (and beta)
    through device-side tensor descriptors and one warp-specialised key loop (docs/design.md §4.4);
    ``WS_FULL_BLOCKS``: that loop needs no index checks (not causal, ``Lk`` a multiple of
    ``BLOCK_N``)."""
    H, Lq, Lk, D, DV, GROUP, num_m_blocks = dims
    # Where this program's rows lie (extents.py): its query block, sequence and statistics rows;
    # (KV cache) the bottom-right shift.
    (m_block, bh, off_b, off_h, off_kv, batch, q_row0, k_row0, Lq, Lk, q_shift,
     past_end) = query_block_rows(num_m_blocks, H, GROUP, seqlens, Lq, Lk, BLOCK_M, VARLEN)
    if past_end:
        return
    row_base, offs_m, offs_d, row_ok = query_rows(m_block, bh, off_h, q_row0, Lq, stat_stride_h, BLOCK_M, BLOCK_D, VARLEN)
    q_base = rows_base(q_strides, batch, q_row0)
    o_base = rows_base(o_strides, batch, q_row0)
    k_base = rows_base(k_strides, batch, k_row0)
    v_base = rows_base(v_strides, batch, k_row0)

    offs_dv = tl.arange(0, BLOCK_DV)

    scale, cap_a, cap_c = logit_scales(scale, softcap, SOFTCAP, ACC)
    P0, P1 = score_params
    cb, coef_head, q_sign = head_coefficients(P0, P1, off_h, scale, cap_c, SCORE, SOFTCAP, ACC)
    if WARP_SPECIALIZE:
        # Triton (3.9) warp-specialises the loop only when Q too is a descriptor load; rows past
        # Lq and columns past D read as zeros, as signed_query_tile's masks give
        q_desc = row_descriptor(Q, q_base, q_strides, off_h, Lq, D, BLOCK_M, BLOCK_D)
        q = (q_desc.load([m_block * BLOCK_M, 0]) * q_sign).to(Q.dtype.element_ty)
    else:
        q = signed_query_tile(Q, q_base, q_strides, off_h, offs_m, offs_d, row_ok, D, q_sign)
    offs_nb = tl.arange(0, BLOCK_N)
    k_ptrs = tile_ptrs(K, k_base, k_strides, off_kv, offs_nb, offs_d)
    v_ptrs = tile_ptrs(V, v_base, v_strides, off_kv, offs_nb, offs_dv)
    mask_base = MASK + off_b * mask_strides[0] + off_h * mask_strides[1]
    k_desc = 0
    v_desc = 0
    if WARP_SPECIALIZE:
        k_desc = row_descriptor(K, k_base, k_strides, off_kv, Lk, D, BLOCK_N, BLOCK_D)
        v_desc = row_descriptor(V, v_base, v_strides, off_kv, Lk, DV, BLOCK_N, BLOCK_DV)

    coef = tl.zeros((BLOCK_M,), dtype=ACC) + coef_head
    mask_scale = tl.zeros((BLOCK_M,), dtype=ACC) + LOG2E
    if ADAPTIVE:
        if WARP_SPECIALIZE:
            # a pointer load here fails Triton 3.9's warp specialisation ("unsupported load type
            # for producer commit"); rows past Lq read as 0 and are never stored
            beta_desc = tl.make_tensor_descriptor(BETA + row_base, shape=[Lq], strides=[1], block_shape=[BLOCK_M])
            beta = beta_desc.load([m_block * BLOCK_M]).to(ACC)
        else:
            beta = tl.load(BETA + row_base + offs_m, mask=row_ok, other=1.0).to(ACC)
        coef = coef * beta
        mask_scale = mask_scale * beta

    sink_l2 = mask_scale
    if SINKS:
        sink_l2 = tl.load(sinks + off_h).to(ACC) * mask_scale  # beta * s_h * log2(e)
        if SPLIT:
            sink_l2 = tl.where(tl.program_id(1) == 0, sink_l2, float("-inf"))
    m_i, l_i = row_start(BLOCK_M, ACC, sink_l2, SINKS)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=ACC)

    drop = dropout_stream(dropout, off_b, off_h, DROPOUT)

    # Key blocks (extents.query_key_ranges); the loops compare key positions with the query
    # positions pos_m (shifted bottom-right for a KV cache).
    win_left, win_right = window_edges(window, WINDOW)
    pos_m, pos_end, lo, a, mid, hi = query_key_ranges(m_block * BLOCK_M, offs_m, Lq, Lk, q_shift, win_left, win_right,
                                                      CAUSAL, WINDOW, SPLIT, BLOCK_M, BLOCK_N)
    row_out = row_base
    if SPLIT:  # partial results go to split slots
        stride_os, stat_stride_s = split_strides
        split = tl.program_id(1).to(tl.int64)
        o_base += split * stride_os
        row_out += split * stat_stride_s
    # WARP_SPECIALIZE: one loop over every key block, each with the boundary stages' logits (the
    # causal diagonal, the ragged end): Triton 3.9's warp specialisation fails on a kernel with
    # a second loop, and drops silently with a branch inside the loop. WS_FULL_BLOCKS (the
    # launcher's promise: not causal, Lk a multiple of BLOCK_N): every block is interior.
    for STAGE in tl.static_range(3):
        if (STAGE != 0 or WINDOW) and (STAGE == 1 or not WARP_SPECIALIZE):
            start, end = stage_range(STAGE, lo, a, mid, hi)
            if WARP_SPECIALIZE:
                start = lo
                end = hi
            acc, l_i, m_i = _fwd_key_blocks(
                acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_base, pos_m, start, end,
                k_strides[2], v_strides[2], mask_strides[2], mask_strides[3], pos_end, Lk, D, DV, cb, coef, mask_scale, cap_a,
                SCORE, CAUSAL, MASK_KIND, STAGE != 1 or (WARP_SPECIALIZE and not WS_FULL_BLOCKS), EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV, ACC, DOT_PRECISION,
                FAST_MATH, BLOCK_M, POLY_EXP2 if STAGE == 1 else 0, win_left, win_right, drop, m_block * BLOCK_M,
                WINDOW, DROPOUT, SOFTCAP, k_desc, v_desc, WARP_SPECIALIZE and STAGE == 1)

    empty = l_i == 0.0
    if DROPOUT:  # survivors scaled by 1 / (1 - p); l_i is the undropped row's sum
        drop_scale = dropout_scale(dropout, DROPOUT, ACC)
        out = acc * (drop_scale / tl.where(empty, 1.0, l_i))[:, None]
    else:
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    o_ptrs = tile_ptrs(O, o_base, o_strides, off_h, offs_m, offs_dv)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + row_out + offs_m, lse, mask=row_ok)
