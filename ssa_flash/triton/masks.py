"""What makes an element of a logit tile inadmissible: the sequence ends, causality, a local
window (boundary tiles only) and an attention mask (every tile).

Tiles come in two kinds, chosen at compile time (``BOUNDARY``): interior tiles lie inside the
sequences and, under ``CAUSAL``, wholly on or below the diagonal (and, under ``WINDOW``, wholly
inside the band ``i - left <= j <= i + right``), so they need no index checks; boundary tiles
(ragged ends, the causal diagonal, the window's edges) check every element. Tiles wholly outside
the causal triangle or the window are never visited (loop bounds, ``extents.py``). An attention
mask applies to every tile. ``MASK_KIND``: 0 none, 1 boolean (True = attend), 2 additive float.

A finite additive mask stays finite, however negative (``torch.finfo(dtype).min`` padding masks):
its base-2 contribution ``mask * mask_scale`` is saturated at ``-MASK_FLOOR2`` (2^100, times
``beta`` under the adaptive temperature) instead of overflowing to ``-inf`` (``finfo(float32).min * log2(e)`` does), so a row whose keys are all masked
that way keeps finite logits (SDPA's uniform row) rather than becoming an empty row; ``-inf``
stays ``-inf``. 2^100 leaves room for ``beta`` (< 2^27) and for any finite logit beside it
without overflow, and is far below any logit that matters (docs/api.md, fully masked rows).
"""
import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)

MASK_NONE = 0
MASK_BOOL = 1
MASK_ADD = 2

#: the saturation of a finite additive mask's base-2 contribution (module docstring)
MASK_FLOOR2 = tl.constexpr(2.0 ** 100)


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
    (``log2(e)``, times the query's temperature if any; broadcastable to the tile), a finite one
    saturated at ``-MASK_FLOOR2`` (module docstring). Interior
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
            raw = raw.to(l2.dtype)
            # the floor in natural-log units, so that beta (in mask_scale) scales it as it scales
            # the rest of the logit: the backward's beta * l2 meets the forward's logits. Clamped
            # before the product (mask_scale > 0 and rounding is monotonic: the value of clamping
            # the product at mask_scale times the floor) for one product and no floor live beside it
            raw = tl.where(raw == float("-inf"), raw,
                           tl.maximum(raw, -MASK_FLOOR2 * LN2, propagate_nan=tl.PropagateNan.ALL))
            l2 = l2 + raw * mask_scale
    if BOUNDARY or MASK_KIND == 1:
        l2 = tl.where(admissible, l2, float("-inf"))
    return l2
