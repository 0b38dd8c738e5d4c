"""Merging the partial results of split-KV decoding (``SPLIT`` in the forward and statistics kernels).

With the keys of a row shared among ``S`` programs, program ``s`` computes over its keys alone the
normalised output ``o_s``, the log-sum-exp ``lse_s`` of its logits and (statistics pass) the entropy
``H_s`` of its weights; a split with no admissible key has ``lse_s = -inf``, ``o_s = 0``, ``H_s = 0``.
With ``lse = log sum_s exp(lse_s)`` and ``w_s = exp(lse_s - lse)`` (the share of the row's weight
that split ``s`` holds):

    o   = sum_s w_s o_s
    H   = sum_s w_s (H_s + lse - lse_s)          (-sum p log p, with p = w_s q on split s's keys)

A row whose every split is empty gets ``o = 0``, ``lse = -inf``, ``H = 0``. One program per row.

These formulas hold for any partition of a row's entries, so an attention sink (``SINKS``) needs
nothing here: it is an entry of split 0's share (the forward and statistics kernels start split
0's rows from the sink, the others from nothing), which counts it exactly once, with its ``beta``
in the output's LSE and without it in the entropy's, as docs/maths.md §6.2 asks.
"""
import triton
import triton.language as tl


@triton.jit
def _split_weights(LSE_PART, row, stat_stride_s, num_splits, BLOCK_S: tl.constexpr, ACC: tl.constexpr):
    """``(w, lse, lse_s, ok)``: the splits' normalised weights ``w_s`` (0 for empty splits), the merged
    natural-log LSE of the row, the partial LSEs, and which split slots exist."""
    offs_s = tl.arange(0, BLOCK_S)
    ok = offs_s < num_splits
    lse_s = tl.load(LSE_PART + offs_s.to(tl.int64) * stat_stride_s + row, mask=ok, other=float("-inf")).to(ACC)
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    e = tl.where(lse_s == float("-inf"), 0.0, tl.exp(lse_s - m_safe))
    total = tl.sum(e, 0)
    empty = total == 0.0
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
    w = e / tl.where(empty, 1.0, total)
    return w, lse, lse_s, ok


@triton.jit
def merge_output_kernel(
    O_PART, LSE_PART, O, LSE, part_strides, o_strides, H, Lq, DV, num_splits, stat_stride_s,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
):
    """``O (B, H, Lq, Dv)`` and ``LSE (B, H, Lq)`` from the partials ``O_PART (S, B, H, Lq, Dv)`` and
    ``LSE_PART (S, B, H, Lq)`` (row ``r`` of split ``s`` at ``s * stat_stride_s + r``); ``part_strides``,
    ``o_strides`` their strides (split, batch, head, row, column), (batch, head, row, column)."""
    stride_ps, stride_pb, stride_ph, stride_pm, stride_pd = part_strides
    stride_ob, stride_oh, stride_om, stride_od = o_strides
    row = tl.program_id(0).to(tl.int64)  # (b * H + h) * Lq + i
    bh = row // Lq
    i = row % Lq
    off_b = bh // H
    off_h = bh % H
    w, lse, lse_s, ok = _split_weights(LSE_PART, row, stat_stride_s, num_splits, BLOCK_S, ACC)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_DV)
    parts = tl.load(O_PART + offs_s[:, None].to(tl.int64) * stride_ps + off_b * stride_pb + off_h * stride_ph + i * stride_pm
                    + offs_d[None, :] * stride_pd, mask=ok[:, None] & (offs_d[None, :] < DV), other=0.0)
    out = tl.sum(w[:, None] * parts.to(ACC), 0)
    tl.store(O + off_b * stride_ob + off_h * stride_oh + i * stride_om + offs_d * stride_od,
             out.to(O.dtype.element_ty), mask=offs_d < DV)
    tl.store(LSE + row, lse)


@triton.jit
def merge_entropy_kernel(ENT_PART, LSE_PART, ENT, LSE, num_splits, stat_stride_s,
                         BLOCK_S: tl.constexpr, ACC: tl.constexpr):
    """Entropy ``ENT`` and LSE ``LSE`` ``(B, H, Lq)`` of whole rows from the statistics pass's
    per-split ``ENT_PART``, ``LSE_PART`` ``(S, B, H, Lq)``."""
    row = tl.program_id(0).to(tl.int64)
    w, lse, lse_s, ok = _split_weights(LSE_PART, row, stat_stride_s, num_splits, BLOCK_S, ACC)
    offs_s = tl.arange(0, BLOCK_S)
    ent_s = tl.load(ENT_PART + offs_s.to(tl.int64) * stat_stride_s + row, mask=ok, other=0.0).to(ACC)
    term = tl.where(w > 0.0, w * (ent_s + lse - lse_s), 0.0)
    tl.store(ENT + row, tl.sum(term, 0))
    tl.store(LSE + row, lse)
