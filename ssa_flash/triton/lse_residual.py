"""The LSE's rounding residual for the backward of calls with an additive mask (``MASK_ADD``).

The backward forms its weights as ``P = exp2(l2 - lse2)`` from the float32 LSE the forward
stored. That is exact enough while ``|lse2|`` is small, but a finite mask can put a whole row at
``finfo.min``-sized logits (a padding mask): there ``lse2 = m + log2(sum)`` rounds to ``m`` (its
ulp is 2^103), ``log2(sum)`` is lost and every weight of a uniform row would come out as 1 instead
of ``1 / n``. So for each row whose ``|lse2|`` is at least ``RESIDUAL_FROM`` the dQ kernel
recounts the row's maximum ``m`` and ``sum = sum_j exp2(l2_j - m)`` with the backward's own
logits, and both backward kernels use the pair ``(hi, lo) = (m, log2(sum))`` in place of
``(lse2, 0)``: ``exp2((l2 - hi) - lo)``, where ``l2 - hi`` is small and exact for every weight
that matters. (The forward's logits may differ from the backward's in their last bit, which at
2^100 is 2^77: only the backward's own recount is consistent with its logits.)

A recount that differs from the given LSE by more than its rounding (``RESIDUAL_TOL`` relative)
means the keys seen are not the whole row (ring attention gives the kernels a shard of it and the
whole row's LSE): then ``(lse2, 0)``, the given LSE as before. Blocks with no such row skip the pass (one runtime
branch per program), so the pass costs a ``Q K^T`` sweep only where huge logits are.
With the adaptive temperature the same holds for the tempered row (``beta * l2``, against the
forward's LSE) and the untempered one (``l2``, against the statistics pass's ``lse_l``).
"""
import triton
import triton.language as tl

from .logits import LOG2E, row_start, safe_row_max, tile_logit_input_and_u
from .masks import boundary_logits
from .tile_loads import load_rows

#: rows with ``|lse2|`` below this need no residual (its ulp, 2^-15, is below float32 noise)
RESIDUAL_FROM = tl.constexpr(256.0)
#: the largest residual taken, relative to ``|lse2|``: the float32 LSE's rounding and a recount's
RESIDUAL_TOL = tl.constexpr(2.0 ** -20)


@triton.jit
def _online(m, total, lt):
    """The running ``(max, sum of exp2(l - max))`` of a row after the tile ``lt`` (``-inf``:
    inadmissible)."""
    m_new = tl.maximum(m, tl.max(lt, 1))
    m_safe = safe_row_max(m_new)
    total = total * tl.exp2(m - m_safe) + tl.sum(tl.exp2(lt - m_safe[:, None]), 1)
    return m_new, total


@triton.jit
def residual(m, total, lse2):
    """``(hi, lo)`` of a row from its recounted ``(m, total)`` and the stored base-2 ``lse2``
    (module docstring): ``(m, log2(total))``, or ``(lse2, 0)`` for an empty row or a recount that
    is not the whole row's."""
    lo = tl.log2(tl.where(total > 0.0, total, 1.0))
    ok = (total > 0.0) & (tl.abs((m - lse2) + lo) <= tl.abs(lse2) * RESIDUAL_TOL)
    return tl.where(ok, m, lse2), tl.where(ok, lo, 0.0)


@triton.jit
def needs_residual(lse2, lse_l2, ADAPTIVE: tl.constexpr):
    """Whether any row of the block has an LSE large enough to need its residual."""
    big = tl.max(tl.abs(lse2), 0)
    if ADAPTIVE:
        big = tl.maximum(big, tl.max(tl.abs(lse_l2), 0))
    return big >= RESIDUAL_FROM


@triton.jit
def row_residual_blocks(m_t, tot_t, m_u, tot_u, q, k_ptrs, mask_base, offs_m, lo, hi, stride_kn,
                        stride_mask_m, stride_mask_n, Lq, Lk, D, cb, coef, cap_a, beta,
                        SCORE: tl.constexpr, ADAPTIVE: tl.constexpr, CAUSAL: tl.constexpr,
                        MASK_KIND: tl.constexpr, BOUNDARY: tl.constexpr, EVEN_D: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr,
                        win_left, win_right, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """Key blocks ``[lo, hi)`` of the recount: the running ``(m_t, tot_t)`` of the tempered row
    ``beta * l2`` (``l2`` without ``ADAPTIVE``) and ``(m_u, tot_u)`` of ``l2`` (``ADAPTIVE``
    only), with the logits exactly as ``backward._dq_key_blocks`` forms them."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_rows(k_ptrs, start_n, stride_kn, offs_n, Lk, D, BLOCK_D, BOUNDARY, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC)
        x, _, _ = tile_logit_input_and_u(s, cb, cap_a, SCORE, SOFTCAP, ACC, FAST_MATH)
        l2 = boundary_logits(x * coef, offs_m, offs_n, Lq, Lk, mask_base, stride_mask_m,
                             stride_mask_n, LOG2E, BOUNDARY, CAUSAL, MASK_KIND, False,
                             win_left, win_right, WINDOW)
        if ADAPTIVE:
            m_t, tot_t = _online(m_t, tot_t, l2 * beta[:, None])
            m_u, tot_u = _online(m_u, tot_u, l2)
        else:
            m_t, tot_t = _online(m_t, tot_t, l2)
    return m_t, tot_t, m_u, tot_u


@triton.jit
def row_start_pair(sink, beta, BLOCK_M: tl.constexpr, ACC: tl.constexpr, SINKS: tl.constexpr):
    """``(m_t, tot_t, m_u, tot_u)`` before any key: empty rows, or the sink's entry (base 2,
    tempered by ``beta`` for the first pair)."""
    m_t, tot_t = row_start(BLOCK_M, ACC, sink * LOG2E * beta, SINKS)
    m_u, tot_u = row_start(BLOCK_M, ACC, sink * LOG2E + tl.zeros((BLOCK_M,), dtype=ACC), SINKS)
    return m_t, tot_t, m_u, tot_u
