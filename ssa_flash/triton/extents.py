"""Where a program's rows lie and which key / query blocks it visits.

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

The block ranges split a program's loop into boundary and interior stages (``masks.py``): blocks
cut by a window's left edge, interior blocks (no index checks), and blocks cut by the causal
diagonal, a window's right edge or the ragged end.
"""
import triton
import triton.language as tl

VARLEN_NONE = 0
VARLEN_PACKED = 1
VARLEN_CACHE = 2
VARLEN_CACHE_START = 3


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
def query_block_program(num_m_blocks, H, GROUP):
    """``(m_block, bh, off_b, off_h, off_kv)`` of a program of a query-block grid (forward,
    statistics, dQ): its query block, ``bh = off_b * H + off_h`` (int64), batch element, query head
    and key/value head. The heaviest (last, under causality) query blocks run first, and
    consecutive programs share K/V in L2."""
    pid = tl.program_id(0)
    m_block = num_m_blocks - 1 - pid % num_m_blocks
    bh = (pid // num_m_blocks).to(tl.int64)
    off_b = bh // H
    off_h = bh % H
    return m_block, bh, off_b, off_h, off_h // GROUP


@triton.jit
def key_block_program(num_n_blocks, HKV):
    """``(n_block, off_b, off_kv)`` of a program of a key-block grid (dK/dV): its key block, batch
    element and key/value head."""
    pid = tl.program_id(0)
    n_block = pid % num_n_blocks
    bhkv = (pid // num_n_blocks).to(tl.int64)
    return n_block, bhkv // HKV, bhkv % HKV


@triton.jit
def rows_base(strides, batch, row0):
    """Offset of this sequence's first row in a 4-D tensor with ``strides = (batch, head, row,
    column)`` (``batch``, ``row0`` from :func:`sequence_extent`)."""
    return batch * strides[0] + row0 * strides[2]


@triton.jit
def tile_ptrs(PTR, base, strides, head, offs_rows, offs_cols):
    """Pointers of the ``(rows, cols)`` tile of head ``head`` at rows ``offs_rows`` and columns
    ``offs_cols`` past ``base`` (:func:`rows_base`) of a 4-D tensor with ``strides``."""
    return PTR + base + head * strides[1] + offs_rows[:, None] * strides[2] + offs_cols[None, :] * strides[3]


@triton.jit
def sequence_extent(CU_Q, CU_K, SEQUSED_K, off_b, Lq, Lk, VARLEN: tl.constexpr):
    """Where batch element (or packed sequence) ``off_b``'s rows lie, for every ``VARLEN`` layout:
    ``(batch, q_row0, k_row0, Lq, Lk, q_shift)``.

    A tensor's rows of this sequence start at ``batch * stride_b + row0 * stride_row`` (plus the
    head's offset): ``batch`` multiplies the batch strides (``off_b``; 0 for a packed batch, whose
    tensors are one ``(1, H, total, D)`` view), ``q_row0`` / ``k_row0`` are the first query / key
    rows along the row stride (int64; the packed offsets, a KV cache's first key row, else 0).
    ``Lq``, ``Lk`` are this sequence's lengths (the arguments for a dense batch), ``q_shift`` the
    KV cache's bottom-right shift ``Lk_b - Lq`` that the loops add to query positions (else 0).
    A dense batch compiles to the constants it always had: the branches are ``tl.constexpr``."""
    batch = off_b
    q_row0 = 0
    k_row0 = 0
    q_shift = 0
    if VARLEN == 1:  # packed sequences
        q_row0, Lq = packed_extent(CU_Q, off_b)
        k_row0, Lk = packed_extent(CU_K, off_b)
        batch = 0
    elif VARLEN >= 2:  # KV cache
        k_row0, Lk = cache_key_extent(CU_K, SEQUSED_K, off_b, Lk, VARLEN == 3)
        q_shift = Lk - Lq
    return batch, q_row0, k_row0, Lq, Lk, q_shift


@triton.jit
def row_stat_base(bh, off_h, q_row0, Lq, stat_stride_h, VARLEN: tl.constexpr):
    """Index of the first row of head ``off_h`` of this sequence in the per-row statistics
    (``bh = off_b * H + off_h``): ``(B, H, Lq)`` tensors, or ``(H, total_q)`` for a packed batch."""
    if VARLEN == 1:
        base = off_h * stat_stride_h + q_row0
    else:
        base = bh * Lq
    return base


@triton.jit
def query_block_rows(num_m_blocks, H, GROUP, seqlens, Lq, Lk, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr):
    """Where a program of a query-block grid (forward, statistics, dQ) works: its
    :func:`query_block_program`, its sequence's :func:`sequence_extent` and ``past_end``, true
    where its block starts past its sequence's end (a packed batch's grid is sized by the longest
    sequence): such a program returns at once, before :func:`query_rows`.
    ``seqlens = (CU_Q, CU_K[, SEQUSED_K])`` (the third only for a KV cache).
    ``(m_block, bh, off_b, off_h, off_kv, batch, q_row0, k_row0, Lq, Lk, q_shift, past_end)``."""
    m_block, bh, off_b, off_h, off_kv = query_block_program(num_m_blocks, H, GROUP)
    SEQUSED_K = seqlens[0]  # read only for a KV cache
    if VARLEN >= 2:
        SEQUSED_K = seqlens[2]
    batch, q_row0, k_row0, Lq, Lk, q_shift = sequence_extent(seqlens[0], seqlens[1], SEQUSED_K, off_b, Lq, Lk,
                                                             VARLEN)
    past_end = False
    if VARLEN == 1:
        past_end = m_block * BLOCK_M >= Lq
    return m_block, bh, off_b, off_h, off_kv, batch, q_row0, k_row0, Lq, Lk, q_shift, past_end


@triton.jit
def query_rows(m_block, bh, off_h, q_row0, Lq, stat_stride_h, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
               VARLEN: tl.constexpr):
    """``(row_base, offs_m, offs_d, row_ok)`` of a query-block program past
    :func:`query_block_rows`' early return: the first row of its per-row statistics
    (:func:`row_stat_base`), its query rows (``(BLOCK_M,)``), the head-dim columns
    (``(BLOCK_D,)``) and which rows exist. (Computed after the return, not in
    ``query_block_rows``: before it they change the packed-batch kernels' compiled code.)"""
    row_base = row_stat_base(bh, off_h, q_row0, Lq, stat_stride_h, VARLEN)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    return row_base, offs_m, tl.arange(0, BLOCK_D), offs_m < Lq


@triton.jit
def key_block_rows(num_n_blocks, HKV, seqlens, Lq, Lk, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr):
    """The same for a program of the key-block grid (dK/dV, dense or packed):
    ``(start_n, off_b, off_kv, batch, q_row0, k_row0, Lq, Lk, past_end)``, ``start_n`` its first
    key; ``seqlens = (CU_Q, CU_K)``."""
    n_block, off_b, off_kv = key_block_program(num_n_blocks, HKV)
    start_n = n_block * BLOCK_N
    batch, q_row0, k_row0, Lq, Lk, _ = sequence_extent(seqlens[0], seqlens[1], seqlens[0], off_b, Lq, Lk, VARLEN)
    past_end = False
    if VARLEN == 1:
        past_end = start_n >= Lk
    return start_n, off_b, off_kv, batch, q_row0, k_row0, Lq, Lk, past_end


@triton.jit
def stage_range(STAGE: tl.constexpr, lo, a, mid, hi):
    """The blocks ``[start, end)`` of loop stage ``STAGE`` of a program whose blocks split as
    ``[lo, a)`` boundary (a window's near edge), ``[a, mid)`` interior (no index checks) and
    ``[mid, hi)`` boundary (the causal diagonal, a window's far edge, the ragged end). Kernels
    run the stages as ``for STAGE in tl.static_range(3)`` with ``BOUNDARY = STAGE != 1``, so
    each stage compiles its own loop and the interior one carries no boundary code."""
    if STAGE == 0:
        start = lo
        end = a
    elif STAGE == 1:
        start = a
        end = mid
    else:
        start = mid
        end = hi
    return start, end


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
def query_key_ranges(m0, offs_m, Lq, Lk, q_shift, win_left, win_right, CAUSAL: tl.constexpr,
                     WINDOW: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What the key loops of the query block at rows ``[m0, m0 + BLOCK_M)`` (``offs_m``) see
    (forward and statistics kernels): ``(pos_m, pos_end, lo, a, mid, hi)``. The query positions
    ``pos_m`` and their bound ``pos_end`` are the rows shifted bottom-right by ``q_shift`` for a KV
    cache; of the key blocks, ``[lo, a)`` are boundary blocks (a window's left edge), ``[a, mid)``
    interior, ``[mid, hi)`` boundary (the causal diagonal, a window's right edge, the ragged end);
    with ``SPLIT`` this program's share."""
    pos0 = m0 + q_shift
    hi = Lk
    mid = interior_end(0, Lk, BLOCK_N)
    if CAUSAL:
        hi = tl.minimum(Lk, pos0 + BLOCK_M)
        # key blocks wholly at or below the first row of this query block
        mid = tl.minimum(mid, (tl.maximum(pos0 + 1, 0) // BLOCK_N) * BLOCK_N)
    lo = 0
    a = 0
    if WINDOW:
        lo, a, mid, hi = window_key_bounds(pos0, hi, mid, win_left, win_right, BLOCK_M, BLOCK_N)
    if SPLIT:
        lo, a, mid, hi = split_key_range(lo, a, mid, hi, BLOCK_N)
    return offs_m + q_shift, Lq + q_shift, lo, a, mid, hi


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
