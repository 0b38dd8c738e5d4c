"""Pieces shared by the forward, backward and entropy kernels.

Every kernel of the family works on one tile of logits at a time, built by :func:`logit_tile`.
Logits are kept in base-2 units (``l2 = l * log2(e)``) so that the exponentials are ``exp2``:

* softmax:  ``l2 = z * log2(e)``
* SSA:      ``l2 = n * sgn(z) * log2(1 + b|z|)``  (= ``phi(z) * log2(e)``; no ``(1 + b|z|)^n`` is
  ever formed, so large ``n`` or ``|z|`` cannot overflow)

Compile-time switches (``tl.constexpr``) select the logit transform (``SSA``), the temperature
(``ADAPTIVE``: per-row beta), causality and the kind of mask (0 none, 1 boolean, 2 additive float).
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

MASK_NONE = 0
MASK_BOOL = 1
MASK_ADD = 2


@triton.jit
def log2_1p(x):
    """``log2(1 + x)`` for ``x >= 0``, accurate also where ``1 + x`` rounds to 1.

    ``log(u) * x / (u - 1)`` with ``u = fl(1 + x)`` cancels the rounding error of ``u`` (Goldberg).
    """
    u = 1.0 + x
    d = u - 1.0
    safe_d = tl.where(d == 0.0, 1.0, d)
    return tl.where(d == 0.0, x * LOG2E, tl.log2(u) * (x / safe_d))


@triton.jit
def combine_scale(scale_hi, scale_lo, ACC: tl.constexpr):
    """The softmax scale as an ACC-dtype value. Python floats reach kernels as float32, so the
    launcher splits the scale into a float32 head and its remainder; in float64 they add up exactly."""
    zero = tl.zeros((1,), dtype=ACC)
    return tl.sum(zero + scale_hi, 0) + scale_lo


@triton.jit
def logit_tile(q, k, offs_m, offs_n, Lq, Lk, scale, b, n,
               mask_ptr, stride_mask_m, stride_mask_n,
               SSA: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of logits.

    q: (BLOCK_M, BLOCK_D) queries; k: (BLOCK_N, BLOCK_D) keys; offs_m/offs_n: their row indices.
    Returns ``(z, phi2, l2)``: the scaled dot products ``z``; ``phi2 = phi(z) * log2(e)`` (finite,
    no mask); ``l2 = (phi(z) + mask) * log2(e)``, ``-inf`` where a key is not admissible (out of
    range, after the query under ``CAUSAL`` with SDPA's top-left alignment, or masked out).
    """
    z = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    if SSA:
        t = log2_1p(b * tl.abs(z))
        phi2 = n * tl.where(z >= 0, t, -t)
    else:
        phi2 = z * LOG2E
    admissible = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
    if CAUSAL:
        admissible = admissible & (offs_n[None, :] <= offs_m[:, None])
    l2 = phi2
    if MASK_KIND != 0:
        # int64: a materialised (Lq, Lk) mask passes 2^31 elements at Lq = Lk = 46341
        mask_ptrs = (mask_ptr + offs_m[:, None].to(tl.int64) * stride_mask_m
                     + offs_n[None, :].to(tl.int64) * stride_mask_n)
        if MASK_KIND == 1:
            keep = tl.load(mask_ptrs, mask=admissible, other=0)
            admissible = admissible & (keep != 0)
        else:
            bias = tl.load(mask_ptrs, mask=admissible, other=0.0)
            l2 = l2 + bias.to(phi2.dtype) * LOG2E
    l2 = tl.where(admissible, l2, float("-inf"))
    return z, phi2, l2


@triton.jit
def safe_row_max(m):
    """The running max with ``-inf`` (a row with nothing admissible yet) replaced by 0, so that
    ``exp2(l2 - m)`` gives 0 instead of NaN."""
    return tl.where(m == float("-inf"), 0.0, m)
