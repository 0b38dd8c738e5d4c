"""Block configurations of the Triton kernels, one table per GPU family, and the shared-memory
estimate that prunes configurations which cannot fit before anything is compiled.

A *family* is a group of compute capabilities with the same tensor-core path and shared-memory
budget per block (the opt-in maximum a kernel may request):

======  ==========================================  =====================  ========
family  GPUs                                        matmul path            smem/blk
======  ==========================================  =====================  ========
75      T4, RTX 20xx                                no MMA in Triton 3.9   64 KB
80      A100, A30 (and sm_87, Jetson Orin)          mma.sync               163 KB
86      A10, A40, A6000, RTX 30xx; sm_89: L4, L40S  mma.sync               99 KB
90      H100, H200                                  wgmma                  227 KB
100     B200, GB200 (sm_100, sm_103, sm_110)        tcgen05 (UTCHMMA)      227 KB
120     RTX 50xx, RTX PRO 6000 (sm_120, sm_121)     mma.sync               99 KB
======  ==========================================  =====================  ========

First choices come from the static audit (``python -m ssa_flash.audit --arch <family>``, the
per-family entry of bench/NOTES.md): the largest tiles whose main loops compile without register
spills and within the family's shared memory. ``tests/audit/test_audit.py`` compiles every family's
first choice at head dim 128 (and 64 on sm_80 / sm_90; dropout, window, packed and decoding
launches included) and fails on a spill or a shared-memory overflow; ``tests/triton/test_tiles.py``
checks the estimate below against every family's limit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

_KB = 1024

#: Largest dynamic shared memory one block may request, per family (bytes).
FAMILY_SMEM = {75: 64 * _KB, 80: 163 * _KB, 86: 99 * _KB, 90: 227 * _KB, 100: 227 * _KB, 120: 99 * _KB}
FAMILIES = tuple(sorted(FAMILY_SMEM))


@dataclass(frozen=True)
class Blocks:
    """One launch configuration: query/key tile sizes, warps per program, pipeline stages, and
    whether the forward kernel runs its warp-specialised form (``WARP_SPECIALIZE``: ``warps``
    is then each partition's, :func:`warp_specialized_forward`)."""

    m: int
    n: int
    warps: int
    stages: int
    ws: bool = False


def family(arch: int) -> int:
    """The family (a key of :data:`FAMILY_SMEM`) of compute capability ``arch`` (e.g. 89 -> 86).
    Unknown capabilities take the nearest older family (the smaller budget below 80)."""
    arch = int(arch)
    if arch >= 120:
        return 120
    if arch >= 100:
        return 100
    if arch >= 90:
        return 90
    if arch in (86, 88, 89):
        return 86
    if arch >= 80:
        return 80
    return 75


def smem_limit(arch: int) -> int:
    """Shared memory (bytes) one block may use on compute capability ``arch``."""
    return FAMILY_SMEM[family(arch)]


def estimate_smem(blk: Blocks, kernel: str, head_block: int, dtype: torch.dtype, arch: int) -> int:
    """Shared memory (bytes) Triton allocates for ``kernel`` with ``blk`` at head-dim tile
    ``head_block`` (queries and values alike), from the tiles it stages there.

    The model (checked against the compiled kernels by ``tests/audit/test_audit.py``): the operand tiles
    a program keeps for its whole life (Q in the forward / statistics, Q and dO in dQ, K and V in
    dK/dV) once, and the tiles each loop step loads (K, V; Q, dO in dK/dV) once per pipeline
    buffer: ``stages`` buffers for wgmma / tcgen05 (sm_90, sm_100 with an M dimension of 64 or
    more: they read both operands from shared memory), ``stages - 1`` (at least 1) for the cp.async pipeline of mma.sync; on mma.sync the
    backward kernels also stage one ``m x n`` tile for a layout conversion. Within a few KB of the
    compiled figure; it only decides which configurations are worth compiling."""
    base = kernel[:-len("_decode")] if kernel.endswith("_decode") else kernel
    e = torch.empty((), dtype=dtype).element_size()
    d = head_block
    m, n = blk.m, blk.n
    # wgmma / tcgen05 on sm_90 / sm_100 where the MMA's M dimension (queries; keys in dK/dV) has
    # 64 rows or more; below that (decoding's 16-row tiles) Triton uses mma.sync there too
    hopper = family(arch) in (90, 100) and (n if base == "bwd_dkdv" else m) >= 64
    buffers = blk.stages if hopper else max(1, blk.stages - 1)
    if base == "fwd":
        elems = m * d + buffers * n * 2 * d
    elif base == "row_entropy":
        elems = m * d + buffers * n * d
    elif base == "bwd_dq":
        elems = 2 * m * d + buffers * n * 2 * d + (0 if hopper else m * n)
    elif base == "bwd_dkdv":
        elems = n * 2 * d + buffers * m * 2 * d + (0 if hopper else m * n)
    else:
        raise ValueError(f"unknown kernel {kernel!r}")
    return e * elems


def fits(blk: Blocks, kernel: str, head_block: int, dtype: torch.dtype, arch: int) -> bool:
    """Whether ``blk``'s estimated shared memory is within the family's budget."""
    return estimate_smem(blk, kernel, head_block, dtype, arch) <= smem_limit(arch)


def prune(cands: List[Blocks], kernel: str, head_block: int, dtype: torch.dtype, arch: Optional[int]):
    """``cands`` without the configurations whose estimate exceeds the family's shared memory, in
    order (so a first call on a small-memory GPU compiles no hopeless configuration). The
    interpreter (``arch`` None) and a list where nothing would remain are returned unchanged:
    compiling then decides."""
    if arch is None:
        return list(cands)
    kept = [c for c in cands if fits(c, kernel, head_block, dtype, arch)]
    return kept or list(cands)


# ------------------------------------------------------------------------------------- the tables
#
# Each table returns the configurations to try, best first, for one of the kernels "fwd",
# "row_entropy" (forward-like), "bwd_dq", "bwd_dkdv" (n = keys per program, the MMA's M dimension;
# m = queries per step). ``hb`` is the head-dim tile (a power of two >= 16).


def _hopper(kernel: str, hb: int, masked: bool, adaptive: bool) -> List[Blocks]:
    """sm_90 (227 KB). wgmma splits a matmul's M dimension over warpgroups of 4 warps in 64-row
    slices, so 8 warps need M >= 128 (queries in fwd / row_entropy / dQ, keys in the transposed dK/dV
    kernel) or both warpgroups would compute the same rows."""
    if kernel in ("fwd", "row_entropy"):
        if hb <= 64:
            # 8 warps on 128 x 128 tiles keep the interior at ~7 instructions per element; with
            # a mask (more live values) 64 x 64 tiles are what compiles without spills
            return ([Blocks(64, 64, 4, 3), Blocks(128, 128, 8, 3)] if masked
                    else [Blocks(128, 128, 8, 3), Blocks(64, 64, 4, 3)])
        if hb <= 128:
            return [Blocks(128, 64, 8, 3), Blocks(64, 64, 4, 2)]
        return [Blocks(64, 32, 4, 2)]
    if kernel == "bwd_dq":
        # with the adaptive temperature the dQ kernel carries a second dQ accumulator (the
        # entropy term's) and more row statistics: smaller tiles keep it out of local memory
        if hb <= 64:
            if masked:
                # a mask's address arithmetic (and an additive mask's recount of large-LSE rows,
                # lse_residual.py) on top: SSA spilled 24-96 B at 64 x 64, SSA + adaptive 8-96 B at
                # 64 x 32 (D 32 / 64, causal, static audit 2026-12-02); a column block less does not
                return [Blocks(64, 16, 4, 2) if adaptive else Blocks(64, 32, 4, 2), Blocks(64, 32, 4, 2),
                        Blocks(64, 64, 4, 2)]
            return [Blocks(64, 32, 4, 2) if adaptive else Blocks(64, 64, 4, 2), Blocks(64, 64, 4, 2)]
        if hb <= 128:
            if adaptive:
                # with a mask one pipeline stage: two spill (132 B) and serialise wgmma (C7515)
                return [Blocks(128, 16, 8, 1 if masked else 2), Blocks(64, 64, 4, 2)]
            return [Blocks(128, 32, 8, 2), Blocks(64, 64, 4, 2)]
        return [Blocks(64, 32, 4, 1)]
    # bwd_dkdv: the dK, dV accumulators and the K, V operands stay live for the whole program
    if hb <= 64:
        return [Blocks(32, 128, 8, 2), Blocks(64, 64, 4, 2)]
    if hb <= 128:
        if adaptive:
            return [Blocks(16, 64, 4, 2), Blocks(64, 64, 4, 2)]
        return [Blocks(16, 128, 8, 2), Blocks(32, 32, 4, 2), Blocks(64, 64, 4, 2)]
    return [Blocks(32, 64, 4, 1)]


def _ampere(kernel: str, hb: int, masked: bool, adaptive: bool, dropout: bool) -> List[Blocks]:
    """sm_80 (163 KB). mma.sync has no warpgroup constraint but fewer registers to spare (its
    operands live in registers, not shared memory): smaller tiles than Hopper's in the backward."""
    if kernel in ("fwd", "row_entropy"):
        if hb <= 64:
            return ([Blocks(64, 64, 4, 3), Blocks(128, 128, 8, 3)] if masked
                    else [Blocks(128, 128, 8, 3), Blocks(64, 64, 4, 3)])
        if hb <= 128:
            return [Blocks(128, 32, 8, 3), Blocks(64, 64, 4, 2)]
        return [Blocks(64, 32, 4, 2)]
    if kernel == "bwd_dq":
        if hb <= 64:
            if adaptive:
                # D <= 32: 16 x 64 (32 x 64 spills with SSA and takes 40% more instructions)
                return [Blocks(16, 64, 4, 2) if hb <= 32 else Blocks(32, 64, 4, 2), Blocks(64, 64, 4, 2)]
            return [Blocks(64, 32, 4, 2), Blocks(64, 64, 4, 2)]
        if hb <= 128:
            return [Blocks(16, 64, 4, 2) if adaptive else Blocks(32, 64, 4, 2), Blocks(64, 64, 4, 2)]
        return [Blocks(64, 32, 4, 1)]
    # bwd_dkdv: few queries per step is what fits the accumulators and K, V in 255 registers
    if hb <= 64:
        cands = [Blocks(16, 128, 8, 2) if adaptive else Blocks(32, 128, 8, 2), Blocks(64, 64, 4, 2)]
    elif hb <= 128:
        cands = ([Blocks(32, 32, 4, 2), Blocks(64, 64, 4, 2)] if adaptive
                 else [Blocks(16, 128, 8, 2), Blocks(32, 32, 4, 2), Blocks(64, 64, 4, 2)])
    else:
        cands = [Blocks(32, 64, 4, 1)]
    if dropout and hb <= 128:
        # The Philox words and the layout conversion of the keep bits (dropout.dropout_keep) cost
        # registers: the default tiles spill (D=64: ~1.4, D=128: ~5 loads/stores per element,
        # SSA). The largest tiles without spills: 16 x 64 at D=64, 32 x 32 at D=128 (32 x 64
        # spilled 1.2-1.6 KB with the adaptive temperature on sm_80 / 86 / 120 and took 68
        # instructions per element in the interior against 32 x 32's 48; static audit).
        cands = [Blocks(16, 64, 4, 2) if hb <= 64 else Blocks(32, 32, 4, 2)] + cands
    return cands


def _ampere_99k(kernel: str, hb: int, masked: bool, adaptive: bool, dropout: bool, window: bool = False,
                sm120: bool = False) -> List[Blocks]:
    """sm_86 / sm_89 and sm_120 (99 KB): mma.sync like sm_80 with the same 64 K registers per SM,
    so sm_80's tiles where they fit 99 KB. They do not at D = 256 in the backward: dK/dV's K and V
    of 64 keys are 64 KB, plus Q and dO (112 KB compiled on sm_80), dQ's 64 x 32 is 96 KB
    compiled (too close to 99 KB for the estimate's margin): 32 x 32 tiles. On sm_120 ptxas
    spills sm_80's dK/dV 16 x 128 at D = 128 (32 B, SSA); 32 x 32 compiles without. The forward
    at D <= 64 with dropout or a window: 128 x 128 spilled (sm_86 32 B, sm_120 308 B, SSA +
    adaptive with dropout, window and a packed batch); 64 x 64 (the masked choice) does not."""
    cands = _ampere(kernel, hb, masked, adaptive, dropout)
    if kernel == "fwd" and hb <= 64 and (dropout or window) and cands[0] != Blocks(64, 64, 4, 3):
        cands = [Blocks(64, 64, 4, 3)] + cands
    if kernel in ("bwd_dq", "bwd_dkdv") and hb > 128:
        cands = [Blocks(32, 32, 4, 1)]
    elif sm120 and kernel == "bwd_dkdv" and 64 < hb <= 128 and cands[0] == Blocks(16, 128, 8, 2):
        cands = [Blocks(32, 32, 4, 2)] + cands
    elif sm120 and kernel == "bwd_dq" and hb <= 64 and adaptive and (dropout or window):
        # 32 x 64 spilled 8 B on sm_120 (SSA + adaptive, dropout + window + packed); 16 x 64 not
        cands = [Blocks(16, 64, 4, 2)] + cands
    return cands


def _turing(kernel: str, hb: int, masked: bool, adaptive: bool, dropout: bool) -> List[Blocks]:
    """sm_75 (64 KB). Triton 3.9 emits no tensor-core instructions for sm_75 (its ``tl.dot``
    becomes FMA loops, static audit): accumulators, score tile and operand fragments all live in
    registers, so tiles far below Ampere's. Static audit (SSA + adaptive temperature, the most
    live values): forward 32 x 32 (4 warps at D <= 64, 8 at D = 128: 4 warps spill 2.2 KB); dQ
    16 x 32 at D <= 64 (32 x 32 spills 2.6 KB), 16 x 16 with 8 warps at D = 128 (16 x 32 spills
    1.8 - 2.9 KB); dK/dV 16 x 32 (8 warps) at D <= 64, 16 x 16 (8 warps) at D = 128. The CUDA C++
    backend is the fast path on these GPUs."""
    if kernel in ("fwd", "row_entropy"):
        return [Blocks(32, 32, 4 if hb <= 64 else 8, 2)] if hb <= 128 else [Blocks(16, 32, 8, 1)]
    if kernel == "bwd_dq":
        return [Blocks(16, 32, 4, 2) if hb <= 64 else Blocks(16, 16, 8, 2 if hb <= 128 else 1)]
    return [Blocks(16, 32, 8, 2) if hb <= 64 else Blocks(16, 16, 8, 2 if hb <= 128 else 1)]


def _hopper_switched(kernel: str, hb: int, masked: bool, adaptive: bool, dropout: bool,
                     window: bool) -> List[Blocks]:
    """sm_90 with dropout or a window (SSA + adaptive temperature, static audit): the dK/dV
    kernel's 32 x 128 at D <= 64 spilled (dropout 76 B; with window and packed batch 56 B) and
    the dQ kernel's 64 x 32 (window 24 B, all three 32 B); 16 x 128 and 64 x 16 (both still
    wgmma) do not. The forward's 128 x 128 at D <= 64 is clean with either switch but spilled
    48 B with both: 64 x 64 then. (dQ and dK/dV at D = 128 still spill: bench/NOTES.md.)"""
    cands = _hopper(kernel, hb, masked, adaptive)
    if hb <= 64 and adaptive and dropout and kernel == "bwd_dkdv":
        cands = [Blocks(16, 128, 8, 2)] + cands
    elif hb <= 64 and adaptive and window and kernel == "bwd_dq":
        cands = [Blocks(64, 16, 4, 2)] + cands
    elif hb <= 64 and kernel == "fwd" and dropout and window and cands[0] != Blocks(64, 64, 4, 3):
        cands = [Blocks(64, 64, 4, 3)] + cands
    elif 64 < hb <= 128 and adaptive and kernel in ("bwd_dq", "bwd_dkdv"):
        # every wgmma tile spilled here (dQ 128 x 16: 48-136 B, 64 x 16 / 64 x 32 more; dK/dV
        # 16 x 64: 64 B with dropout): Ampere's mma.sync tiles, which do not
        cands = [Blocks(16, 64, 4, 2) if kernel == "bwd_dq" else Blocks(32, 32, 4, 2)] + cands
    return cands


def _blackwell(kernel: str, hb: int, masked: bool, adaptive: bool, dropout: bool, window: bool) -> List[Blocks]:
    """sm_100 (227 KB): tcgen05 keeps the accumulators in tensor memory, and M-slicing like
    wgmma's (Triton lowers 8 warps on 128-row tiles), so Hopper's tiles, except the forward with
    dropout or a window, where Hopper's 128 x 128 / 128 x 64 spilled (0.9 - 1.8 KB, static
    audit): at D <= 64 64 x 64 with 4 warps, at D = 128 128 x 32 with 8 warps (64 x 64 spills
    340 B there; with dropout, a window and a packed batch together, SSA + adaptive); and dK/dV
    at D <= 64 with dropout or a window (below)."""
    cands = _hopper(kernel, hb, masked, adaptive)
    if kernel == "fwd" and (dropout or window) and hb <= 128:
        cands = [Blocks(64, 64, 4, 3) if hb <= 64 else Blocks(128, 32, 8, 3)] + cands
    if kernel == "bwd_dkdv" and (dropout or window) and hb <= 64:
        # Hopper's 32 x 128 spilled 180 B (SSA + adaptive, dropout + window + packed); 16 queries
        # per step do not
        cands = [Blocks(16, 128, 8, 2)] + cands
    return cands


def block_candidates(arch: Optional[int], head_block: int, dtype: torch.dtype, kernel: str,
                     masked: bool = False, adaptive: bool = False, dropout: bool = False,
                     window: bool = False) -> List[Blocks]:
    """Configurations to try for ``kernel`` on a GPU of compute capability ``arch`` (e.g. 90;
    None: the interpreter), best first; ``masked``: the launch reads an attention mask;
    ``adaptive``: the adaptive temperature's backward (more live tiles per element);
    ``dropout``: the specialisation generates dropout bits, whose registers some kernels'
    default tiles cannot spare; ``window``: a local window (more index arithmetic per tile).
    Under the interpreter small blocks make the tests cross block boundaries at small lengths.
    On a GPU the launcher drops those whose shared memory cannot fit (:func:`prune`) and times
    the others once (``block_choice.launch_kernel``)."""
    if arch is None:
        return [Blocks(16, 16, 4, 1)]
    fam = family(arch)
    if fam == 75:
        cands = _turing(kernel, head_block, masked, adaptive, dropout)
    elif fam == 80:
        cands = _ampere(kernel, head_block, masked, adaptive, dropout)
    elif fam in (86, 120):
        cands = _ampere_99k(kernel, head_block, masked, adaptive, dropout, window, sm120=fam == 120)
    elif fam == 90:
        cands = (_hopper_switched(kernel, head_block, masked, adaptive, dropout, window) if dropout or window
                 else _hopper(kernel, head_block, masked, adaptive))
    else:
        cands = _blackwell(kernel, head_block, masked, adaptive, dropout, window)
    if dtype in (torch.float32, torch.float64):
        # 4-byte operands: twice the registers and shared memory per tile, so halved tiles first,
        # with the same warps (sm_90 forward D=128: 64 x 32 with 8 warps compiles TF32 to HGMMA
        # split over N without spills; IEEE with 4 warps spilled 67 KB, with 8 warps 2.3 KB)
        cands = [Blocks(max(16, c.m // 2), max(16, c.n // 2), c.warps, c.stages) for c in cands] + cands
    return cands + [Blocks(32, 32, 4, 1), Blocks(16, 16, 4, 1)]


def warp_specialized_forward(arch: Optional[int], head_block: int, dtype: torch.dtype) -> Optional[Blocks]:
    """The forward kernel's warp-specialised configuration (``WARP_SPECIALIZE``) on compute
    capability ``arch``, or None where there is none: sm_90, 16-bit inputs, head-dim tiles of 64
    and 128. Triton 3.9 specialises only with 4 warps (it splits the 128 query rows over two
    consumer warpgroups of 4 warps and adds a producer); 3 stages at D = 128 ask for more than
    227 KB, 2 fit (static audit: 131 KB at D = 128 with 128 x 64 tiles)."""
    if arch is None or family(arch) != 90 or dtype not in (torch.float16, torch.bfloat16):
        return None
    if head_block == 64:
        return Blocks(128, 128, 4, 2, True)
    if head_block == 128:
        return Blocks(128, 64, 4, 2, True)
    return None


def decode_candidates(arch: Optional[int], head_block: int, dtype: torch.dtype) -> List[Blocks]:
    """Configurations for the forward and statistics kernels on a KV cache with at most 16 queries
    per row block (decoding): 16-row query tiles (the smallest ``tl.dot`` takes; a decoding step is
    bound by reading the cache, not by the tensor cores), wide key tiles and deep pipelines to keep
    loads in flight: the first of a ladder that the family's shared memory holds (by the
    estimate). 16-bit at D <= 128: 128 keys x 3 stages (K, V buffers of 64 KB at D = 128) where
    it fits (sm_80, sm_90, sm_100); 64 keys x 3 stages on the 99 KB families (128 keys ask 136 KB);
    otherwise 64 keys x 2 stages and down. sm_75 (FMA dots, 64 KB) starts at 32 keys."""
    if arch is None:
        return [Blocks(16, 16, 4, 1)]
    if head_block <= 128 and dtype not in (torch.float32, torch.float64):
        ladder = [Blocks(16, 128, 4, 3), Blocks(16, 64, 4, 3), Blocks(16, 64, 4, 2)]
    else:
        ladder = [Blocks(16, 64, 4, 2)]
    ladder += [Blocks(16, 32, 4, 2), Blocks(16, 32, 4, 1), Blocks(16, 16, 4, 2)]
    if family(arch) == 75:
        ladder = [b for b in ladder if b.n <= 32]
    cands = [b for b in ladder if fits(b, "fwd", head_block, dtype, arch)]
    return cands + [Blocks(16, 16, 4, 1)]


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    # plain Python: triton.cdiv / next_power_of_2 are constexpr functions (Triton 3.9), ~10 us
    # per host call
    return -(-a // b)
