"""Philox4x32-10, the counter-based generator of the dropout keep bits (``dropout.py``): the same
bits as Random123's ``philox4x32_R(10)`` and cuRAND's Philox4_32_10.
"""
import triton
import triton.language as tl

# Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011)
PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
PHILOX_ROUNDS = tl.constexpr(10)


def _mul_wide_asm(m: int) -> str:
    return "{ .reg .u64 t; mul.wide.u32 t, $2, %d; mov.b64 {$1, $0}, t; }" % m


PHILOX_M0_ASM = tl.constexpr(_mul_wide_asm(PHILOX_M0.value))
PHILOX_M1_ASM = tl.constexpr(_mul_wide_asm(PHILOX_M1.value))


@triton.jit
def _mulhilo32(a, m: tl.constexpr, ASM: tl.constexpr, FAST_MATH: tl.constexpr):
    """``(hi, lo)``: the 32-bit halves of the product of the uint32 tile ``a`` and ``m``. On a GPU
    one ``mul.wide.u32`` (IMAD.WIDE.U32); ptxas does not fuse the separate ``mul.hi``/``mul.lo``
    of the portable form (and a 64-bit product in Triton would stop the layout propagation that
    keeps ``dropout_keep`` free of data movement)."""
    if FAST_MATH:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r", [a], dtype=(tl.uint32, tl.uint32),
                                         is_pure=True, pack=1)
    else:
        return tl.umulhi(a, m), a * m  # uint32: wraps (Triton checks overflow only in debug mode)


@triton.jit
def philox4x32(c0, c1, c2, c3, k0, k1, FAST_MATH: tl.constexpr):
    """Philox4x32-10 of the counter ``(c0, c1, c2, c3)`` under the key ``(k0, k1)`` (uint32
    tensors / scalars): four uint32 tensors, the same bits as Random123's ``philox4x32_R(10)`` and
    cuRAND's Philox4_32_10. Each round is two 32x32->64 multiplies (IMAD.WIDE.U32 on a GPU) and
    two 3-input XORs (LOP3); the key schedule is per program (uniform registers)."""
    for _ in tl.static_range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo32(c0, PHILOX_M0, PHILOX_M0_ASM, FAST_MATH)
        hi1, lo1 = _mulhilo32(c2, PHILOX_M1, PHILOX_M1_ASM, FAST_MATH)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + PHILOX_W0
        k1 = k1 + PHILOX_W1
    return c0, c1, c2, c3
