"""A kernel that materialises the dropout keep-mask of the attention kernels (tests, inspection).

It calls ``common.dropout_keep``, the function every attention kernel uses, on tiles of its own
size: its output equals the kernels' mask only because that function depends on the indices
alone (seed, offset, batch, head, query, key), not on the tiling.
"""
import triton
import triton.language as tl

from .common import dropout_keep, dropout_state


@triton.jit
def dropout_mask_kernel(OUT, RNG, keep31, H, Lq, Lk,
                        stride_ob, stride_oh, stride_om, stride_on, num_m_blocks, num_n_blocks,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST_MATH: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of ``OUT (B, H, Lq, Lk)`` (uint8: 1 = kept) per program."""
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
