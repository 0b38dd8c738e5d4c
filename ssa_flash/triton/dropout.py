"""The dropout keep-mask: which elements of the attention weights dropout keeps, and a kernel that
materialises it (tests, inspection).

Dropout (``DROPOUT``) keeps element ``(b, h, i, j)`` of the final weights iff a Philox4x32-10
draw (``philox.py``) is below a threshold; see :func:`dropout_keep` for the exact function of
(seed, offset, batch, head, query, key), which does not depend on the tiles, so every kernel
(whatever its block sizes or orientation) regenerates the same mask. ``dropout_mask_kernel``
calls it on tiles of its own size: its output equals the kernels' mask only because of that.
"""
import triton
import triton.language as tl

from .philox import philox4x32


@triton.jit
def dropout_keep(seed_lo, seed_hi, head_ctr, batch_ctr, start_q, start_k, keep_below,
                 BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, KEYS_FIRST: tl.constexpr,
                 FAST_MATH: tl.constexpr):
    """The dropout keep-mask of queries ``[start_q, start_q + BLOCK_Q)`` x keys
    ``[start_k, start_k + BLOCK_K)``: a boolean tile (queries, keys), or (keys, queries) with
    ``KEYS_FIRST``. ``start_q``, ``start_k``, BLOCK_Q and BLOCK_K are multiples of 16.

    Element (b, h, i, j) is kept iff ``r < keep_below`` where ``r`` is word
    ``bit3(i) + 2 bit0(j)`` of Philox4x32-10 with key ``(seed_lo, seed_hi)`` (the 64-bit seed)
    and counter ``(j // 2, (i // 16) 8 + i % 8, h, (b + offset) mod 2^32)``; ``head_ctr = h``,
    ``batch_ctr = b + offset`` (uint32). One Philox evaluation serves the four elements
    ``{i, i + 8} x {j, j + 1}`` (i with bit 3 clear, j even): exactly what one thread holds of
    a tensor-core accumulator tile (queries x keys; mma.sync and wgmma alike: rows r and r + 8,
    columns 2t and 2t + 1), so in the forward and dQ kernels the words reach their elements with
    no data movement. The dK/dV kernel's transposed tiles hold them in other threads and pay a
    layout conversion (of the 32-bit words, compared after it: see the body). Nothing depends
    on the tile shape, so kernels with different tiles agree.
    ``ssa_flash.reference.dropout_keep_mask`` is the same function in PyTorch."""
    tl.static_assert(BLOCK_Q % 16 == 0 and BLOCK_K % 16 == 0, "dropout tiles: multiples of 16")
    HQ: tl.constexpr = BLOCK_Q // 2
    HK: tl.constexpr = BLOCK_K // 2
    # Counter words of the half tile (x' = (x // 16) 8 + x % 8 runs over start / 2 + [0, B / 2))
    # from one flat arange: no broadcast in the chain, so the compiler can place the whole
    # Philox computation in the layout the joins below need.
    flat = tl.arange(0, HQ * HK).to(tl.uint32)
    if KEYS_FIRST:
        c0 = tl.reshape(flat // HQ, (HK, HQ)) + tl.cast(start_k // 2, tl.uint32)
        c1 = tl.reshape(flat % HQ, (HK, HQ)) + tl.cast(start_q // 2, tl.uint32)
    else:
        c0 = tl.reshape(flat % HK, (HQ, HK)) + tl.cast(start_k // 2, tl.uint32)
        c1 = tl.reshape(flat // HK, (HQ, HK)) + tl.cast(start_q // 2, tl.uint32)
    zero = c0 * 0
    r0, r1, r2, r3 = philox4x32(c0, c1, zero + head_ctr, zero + batch_ctr, seed_lo, seed_hi, FAST_MATH)
    # words: r0 (i, j), r1 (i + 8, j), r2 (i, j + 1), r3 (i + 8, j + 1). tl.join adds the
    # fastest register dim: the outer join over bit0(j), the accumulators' first register bit.
    # The uint32 words are joined and moved, and compared with keep_below only in the tile's
    # final layout (the same comparison per element as comparing first). Joined i1 tiles need
    # i1 layout conversions wherever the tile's layout is not the accumulator's (FMA dots, a
    # bool mask's one-byte load layout), and Triton 3.6 lowers some of them wrongly (packed bytes
    # and byte permutes across lanes; wrong keep bits on an H200, bench/gpu_diag/bool_mask.md).
    # 32-bit words are never packed.
    t = tl.join(tl.join(r0, r1), tl.join(r2, r3))
    if KEYS_FIRST:  # t[j', i', u, s] -> [j', s, a, u, x]
        t = tl.reshape(t, (HK, BLOCK_Q // 16, 8, 2, 2))
        t = tl.reshape(tl.permute(t, (0, 4, 1, 3, 2)), (BLOCK_K, BLOCK_Q))
    else:  # t[i', j', u, s] -> [a, u, x, j', s]
        t = tl.reshape(t, (BLOCK_Q // 16, 8, HK, 2, 2))
        t = tl.reshape(tl.permute(t, (0, 3, 1, 2, 4)), (BLOCK_Q, BLOCK_K))
    return t < keep_below


@triton.jit
def tile_keep(drop, start_q, start_k, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, KEYS_FIRST: tl.constexpr,
              FAST_MATH: tl.constexpr):
    """:func:`dropout_keep` of a tile from a program's ``drop = (seed_lo, seed_hi, head_ctr,
    batch_ctr, keep_below)`` (:func:`dropout_state`)."""
    seed_lo, seed_hi, head_ctr, batch_ctr, keep_below = drop
    return dropout_keep(seed_lo, seed_hi, head_ctr, batch_ctr, start_q, start_k, keep_below,
                        BLOCK_Q, BLOCK_K, KEYS_FIRST, FAST_MATH)


@triton.jit
def dropout_state(RNG, off_b, off_h, keep31):
    """Per-program dropout constants from the ``(2,)`` int64 tensor ``RNG = (seed, offset)``:
    ``(seed_lo, seed_hi, head_ctr, batch_ctr, keep_below)`` as uint32 (see :func:`dropout_keep`;
    ``keep_below = 2 * keep31``, ``keep31 = round((1 - p) 2^31)``)."""
    seed = tl.load(RNG)
    offset = tl.load(RNG + 1)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    batch_ctr = ((off_b + offset) & 0xFFFFFFFF).to(tl.uint32)
    head_ctr = off_h.to(tl.uint32)
    keep_below = keep31.to(tl.uint32) * 2
    return seed_lo, seed_hi, head_ctr, batch_ctr, keep_below


@triton.jit
def dropout_mask_kernel(OUT, RNG, keep31, H, Lq, Lk, out_strides, num_m_blocks, num_n_blocks,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST_MATH: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of ``OUT (B, H, Lq, Lk)`` (uint8: 1 = kept) per program;
    ``out_strides``: its (batch, head, query, key) strides."""
    stride_ob, stride_oh, stride_om, stride_on = out_strides
    pid = tl.program_id(0)
    m_block = pid % num_m_blocks
    n_block = (pid // num_m_blocks) % num_n_blocks
    bh = (pid // (num_m_blocks * num_n_blocks)).to(tl.int64)
    off_b = bh // H
    off_h = bh % H
    seed_lo, seed_hi, head_ctr, batch_ctr, keep_below = dropout_state(RNG, off_b, off_h, keep31)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    start_n = n_block * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    keep = dropout_keep(seed_lo, seed_hi, head_ctr, batch_ctr, m_block * BLOCK_M, start_n, keep_below,
                        BLOCK_M, BLOCK_N, False, FAST_MATH)
    ptrs = (OUT + off_b * stride_ob + off_h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om
            + offs_n[None, :].to(tl.int64) * stride_on)
    tl.store(ptrs, keep.to(tl.uint8), mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk))
