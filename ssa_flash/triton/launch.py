"""Host side of the Triton kernels: block sizes, strides, grids, launches.

Tensors arrive already validated (see ``ssa_flash.ops``): ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``,
``v (B, Hkv, Lk, Dv)`` with any strides; ``mask`` is None or a boolean / floating tensor already
expanded (as a view) to ``(B, Hq, Lq, Lk)``; ``b``, ``n`` are None (softmax) or contiguous
``(Hq,)`` tensors in the accumulation dtype. Per-row statistics are contiguous ``(B, Hq, Lq)``.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np
import torch
import triton
import triton.language as tl

from .backward import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel
from .common import MASK_ADD, MASK_BOOL, MASK_NONE
from .dropout import dropout_mask_kernel
from .entropy import row_entropy_kernel
from .forward import attention_fwd_kernel

_MAX_GRID = 2**31 - 1


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class AttentionSpec:
    """What the kernels compute, apart from the tensors."""

    scale: float
    causal: bool
    group: int  # query heads per key/value head (GQA); 1 without GQA
    ssa: bool
    adaptive: bool
    dropout_p: float = 0.0  # in [0, 1]; 0: the kernels compile without dropout
    rng: Optional[torch.Tensor] = field(default=None, compare=False)  # (seed, offset) int64 (2,)
    window_left: int = -1  # query i attends keys j >= i - window_left; -1: unbounded
    window_right: int = -1  # ... and j <= i + window_right; -1: unbounded


class TemperatureState(NamedTuple):
    """Per-row tensors ``(B, Hq, Lq)`` of the adaptive temperature, kept for the backward."""

    beta: torch.Tensor  # the temperature applied to the row
    lse_l: torch.Tensor  # log-sum-exp of the temperature-free row l
    entropy: torch.Tensor  # H = entropy of softmax(l)
    dbeta_dh: torch.Tensor  # d beta / d H where the temperature is active, else 0


@dataclass(frozen=True)
class Blocks:
    """One launch configuration: query/key tile sizes, warps per program, pipeline stages."""

    m: int
    n: int
    warps: int
    stages: int


@dataclass(frozen=True)
class KernelLaunch:
    """Everything that decides what a kernel launch compiles to and runs: the kernel, its grid,
    positional arguments, ``tl.constexpr`` keyword arguments (block sizes included) and compile
    options. :func:`capture_launches` records these instead of running them (the static audit
    compiles exactly what the launcher would launch)."""

    name: str  # "fwd", "stats", "bwd_dq" or "bwd_dkdv"
    kernel: object
    grid: tuple
    args: tuple
    constexprs: dict
    blocks: Blocks
    candidates: tuple  # every configuration the launcher may choose for this specialisation


def _acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _head_block(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def block_candidates(arch: Optional[int], head_block: int, dtype: torch.dtype, kernel: str,
                     masked: bool = False, dropout: bool = False):
    """Configurations to try for ``kernel`` on a GPU of compute capability ``arch`` (e.g. 90;
    None: the interpreter), best first; ``masked``: the launch reads an attention mask;
    ``dropout``: the specialisation generates dropout bits, whose registers the dK/dV kernel's
    default tiles cannot spare. Under the interpreter small blocks make the tests cross block
    boundaries at small lengths. On a GPU the candidates that fit the shared memory and registers
    are timed once (see ``_launch``)."""
    if arch is None:
        return [Blocks(16, 16, 4, 1)]
    wide = dtype in (torch.float32, torch.float64)
    # First choices come from the static audit (python -m ssa_flash.audit; bench/NOTES.md): the
    # largest tiles whose main loops compile without register spills. Hopper's wgmma splits a
    # matmul's M dimension over warpgroups of 4 warps in 64-row slices, so 8 warps need M >= 128
    # (M: queries in fwd/stats/dQ, keys in the transposed dK/dV kernel) or both warpgroups
    # would compute the same rows. Ampere's mma.sync has no such constraint but fewer registers
    # to spare (its operands live in registers, not shared memory).
    hopper = arch >= 90
    if kernel in ("fwd", "stats"):
        if head_block <= 64:
            # 8 warps on 128 x 128 tiles keep the interior at ~7 instructions per element; with
            # a mask (more live values) 64 x 64 tiles are what compiles without spills
            cands = ([Blocks(64, 64, 4, 3), Blocks(128, 128, 8, 3)] if masked
                     else [Blocks(128, 128, 8, 3), Blocks(64, 64, 4, 3)])
        elif head_block <= 128:
            cands = [Blocks(128, 64, 8, 3) if hopper else Blocks(128, 32, 8, 3), Blocks(64, 64, 4, 2)]
        else:
            cands = [Blocks(64, 32, 4, 2)]
    elif kernel == "bwd_dq":
        if head_block <= 64:
            cands = [Blocks(64, 64, 4, 2) if hopper else Blocks(64, 32, 4, 2), Blocks(64, 64, 4, 2)]
        elif head_block <= 128:
            cands = [Blocks(128, 32, 8, 2) if hopper else Blocks(32, 64, 4, 2), Blocks(64, 64, 4, 2)]
        else:
            cands = [Blocks(64, 32, 4, 1)]
    else:  # bwd_dkdv: n = keys per program (the M dimension), m = queries per step
        # The dK, dV accumulators and the K, V operands stay in registers for the whole program:
        # few queries per step is what fits 255 registers without spilling.
        if head_block <= 64:
            cands = [Blocks(32, 128, 8, 2), Blocks(64, 64, 4, 2)]
        elif head_block <= 128:
            cands = [Blocks(16, 128, 8, 2), Blocks(32, 32, 4, 2), Blocks(64, 64, 4, 2)]
        else:
            cands = [Blocks(32, 64, 4, 1)]
    if dropout and kernel == "bwd_dkdv" and head_block <= 128 and not hopper:
        # The Philox words and the layout conversion of the keep bits (see common.dropout_keep)
        # cost registers. On sm_90 the default tiles still compile without spills; on sm_80 they
        # spill (D=64: ~1.4, D=128: ~5 loads/stores per element, SSA). The static audit's choice:
        # the largest tiles without spills at D=64; at D=128 32 x 64 (~1 spill per element),
        # because the spill-free 16 x 64 costs 50% more instructions.
        cands = [Blocks(16, 64, 4, 2) if head_block <= 64 else Blocks(32, 64, 4, 2)] + cands
    if wide:
        cands = [Blocks(max(16, c.m // 2), max(16, c.n // 2), c.warps, c.stages) for c in cands] + cands
    return cands + [Blocks(32, 32, 4, 1), Blocks(16, 16, 4, 1)]


_chosen_blocks: dict = {}
_capture: Optional[list] = None
_capture_arch: Optional[int] = None


@contextmanager
def capture_launches(arch: int):
    """Within this context the launcher records a :class:`KernelLaunch` per kernel launch (with
    the configuration it would choose first on compute capability ``arch``) instead of running
    it. Call the host functions with ``meta`` tensors: outputs are allocated, nothing runs."""
    global _capture, _capture_arch
    if _capture is not None:
        raise RuntimeError("capture_launches is not re-entrant")
    _capture, _capture_arch = [], int(arch)
    try:
        yield _capture
    finally:
        _capture, _capture_arch = None, None


def _device_arch(device: torch.device) -> Optional[int]:
    if interpreting() or device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _autotuning() -> bool:
    return os.environ.get("SSA_FLASH_AUTOTUNE", "1") not in ("", "0")


def _timed(run) -> float:
    """Median milliseconds of ``run()`` after warm-up (``triton.testing.do_bench``)."""
    return float(triton.testing.do_bench(run, warmup=5, rep=25, return_mode="median"))


def _launch(kernel, name: str, grid_fn, args, consts, device, head_block, dtype):
    """Launch ``kernel`` with the best block configuration for this GPU.

    The first time a specialisation meets a problem size (bucketed by the power of two of its
    program count), every candidate of :func:`block_candidates` that fits the GPU's resources is
    timed on the real arguments and the fastest is kept (all kernels of the family are idempotent:
    they only write their outputs). ``SSA_FLASH_AUTOTUNE=0``, CUDA-graph capture and the
    interpreter take the first candidate that fits instead."""
    arch = _capture_arch if _capture is not None else _device_arch(device)
    cands = block_candidates(arch, head_block, dtype, name, masked=consts.get("MASK_KIND", 0) != 0,
                             dropout=bool(consts.get("DROPOUT", False)))
    if _capture is not None:
        blk = cands[0]
        _capture.append(KernelLaunch(name, kernel, grid_fn(blk), tuple(args(blk)),
                                     dict(consts, BLOCK_M=blk.m, BLOCK_N=blk.n), blk, tuple(cands)))
        return blk
    bucket = triton.next_power_of_2(max(1, grid_fn(cands[0])[0]))
    key = (name, device, head_block, dtype, bucket, tuple(sorted(consts.items())))
    if key in _chosen_blocks:
        cands = [_chosen_blocks[key]]
    tune = (arch is not None and len(cands) > 1 and _autotuning()
            and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()))
    best, best_ms, last_err = None, float("inf"), None
    for blk in dict.fromkeys(cands):  # de-duplicated, in order
        grid = grid_fn(blk)
        if grid[0] > _MAX_GRID:
            raise ValueError(f"ssa_flash: problem too large for one launch ({grid[0]} programs)")
        extra = {} if arch is None else {"num_warps": blk.warps, "num_stages": blk.stages}
        blk_args = args(blk)

        def run(blk=blk, grid=grid, blk_args=blk_args, extra=extra):
            kernel[grid](*blk_args, **consts, BLOCK_M=blk.m, BLOCK_N=blk.n, **extra)

        try:
            run()
        except triton.runtime.errors.OutOfResources as err:  # too much shared memory / registers
            last_err = err
            continue
        if not tune:
            _chosen_blocks[key] = blk
            return blk
        ms = _timed(run)
        if ms < best_ms:
            best, best_ms = blk, ms
    if best is None:
        raise RuntimeError(f"ssa_flash: no block configuration of {name} fits this GPU") from last_err
    if best != blk:  # leave the outputs of the chosen configuration (some depend on the tiles)
        extra = {"num_warps": best.warps, "num_stages": best.stages}
        kernel[grid_fn(best)](*args(best), **consts, BLOCK_M=best.m, BLOCK_N=best.n, **extra)
    _chosen_blocks[key] = best
    return best


def _check_offsets(*tensors):
    """Kernels index (batch, head) slices with int64 and positions inside one slice with int32."""
    for t in tensors:
        span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape[2:], t.stride()[2:]))
        if span >= 2**31:
            raise ValueError(f"ssa_flash: one (batch, head) slice of a tensor of shape {tuple(t.shape)} "
                             f"and strides {t.stride()} spans {span} elements; the Triton kernels "
                             "support up to 2^31 per slice (make the tensor contiguous)")


def _split_scale(scale: float):
    """Python floats reach kernels as float32: pass the scale as float32 head + remainder."""
    hi = float(np.float32(scale))
    return hi, float(np.float32(scale - hi))


def _mask_args(mask: Optional[torch.Tensor], like: torch.Tensor):
    if mask is None:
        return like, MASK_NONE, (0, 0, 0, 0)
    if mask.dtype == torch.bool:  # bytes: kernels read 0 / non-zero, not i1 pointers
        return mask.view(torch.uint8), MASK_BOOL, tuple(mask.stride())
    return mask, MASK_ADD, tuple(mask.stride())


def _fast_math(q) -> bool:
    """Hardware approximations (``lg2.approx``, ``rcp.approx``) on a GPU in float32 accumulation;
    the interpreter runs exact maths (it cannot run inline PTX)."""
    on_gpu = _capture is not None or (q.device.type == "cuda" and not interpreting())
    return on_gpu and q.dtype != torch.float64


def keep_threshold(p: float) -> int:
    """``keep31 = round((1 - p) 2^31)`` (at most 2^31 - 1): the kernels keep an element iff its
    32-bit Philox word is below ``2 keep31``, i.e. with probability ``keep31 / 2^31``, which is
    ``1 - p`` to within 2^-32."""
    return min(int(round((1.0 - p) * 2.0**31)), 2**31 - 1)


def _feature_args(q, Lq: int, Lk: int, spec: AttentionSpec):
    """The trailing runtime arguments of the attention kernels, ``(RNG, keep31, drop_scale_hi,
    drop_scale_lo, win_left, win_right)``, and their ``DROPOUT`` / ``WINDOW`` constexprs. Without
    dropout or a window they are None, which Triton turns into constants: the kernels then take
    exactly the parameters they took before these features. An unbounded side of a window is
    passed as ``Lq + Lk``, which no index difference reaches."""
    dropout = spec.dropout_p > 0.0
    if dropout:
        if spec.rng is None:
            raise ValueError("ssa_flash: dropout_p > 0 needs the (seed, offset) tensor spec.rng")
        p = float(spec.dropout_p)
        drop_args = (spec.rng, keep_threshold(p), *_split_scale(1.0 / (1.0 - p) if p < 1.0 else 0.0))
    else:
        drop_args = (None, None, None, None)
    window = spec.window_left >= 0 or spec.window_right >= 0
    unbounded = Lq + Lk
    left = min(spec.window_left, unbounded) if spec.window_left >= 0 else unbounded
    right = min(spec.window_right, unbounded) if spec.window_right >= 0 else unbounded
    win_args = (left, right) if window else (None, None)
    return (*drop_args, *win_args), dict(DROPOUT=dropout, WINDOW=window)


# Tests set this to 3 or 4 to run the polynomial exp2 under the interpreter (see below).
FORCE_POLY_EXP2: Optional[int] = None


def _poly_exp2_degree(q, spec: AttentionSpec, head_block: int, kernel: str) -> int:
    """Degree of the polynomial ``exp2`` (``common.exp2_poly``) that computes half of the interior
    tiles' MUFU work on the FMA pipe, or 0 for none: in the forward half of the weights' exp2, in
    the dK/dV kernel half of SSA's reciprocals ``1 / (1 + b|z|) = 2^-|x|``. Only where the
    audit's bound says it pays: SSA (two MUFU ops per element in the forward, LG2 and EX2; three
    in the backward, with RCP) at head dims <= 64, where the MUFU time (1/16 clock per op and
    element on sm_80/sm_90) exceeds the tensor and the issue time; on a GPU with 16-bit inputs
    (degree 3, relative error 7.5e-5, for bfloat16's 2^-9 rounding; degree 4, 2.6e-6, for
    float16's 2^-11).

    The forward and the dQ kernel keep the hardware exp2 / reciprocal unless
    ``SSA_FLASH_POLY_EXP2=1``: there the polynomial lowers the bound (forward D=64 bf16 sm_90:
    0.127 -> 0.102 clock per element) but raises SSA's instructions per element past the audit's
    gates (1.5x softmax's in the forward, 2.0x in the backward; bench/NOTES.md). A GPU
    measurement should decide."""
    if FORCE_POLY_EXP2 is not None:
        return FORCE_POLY_EXP2
    if kernel != "bwd_dkdv" and os.environ.get("SSA_FLASH_POLY_EXP2", "0") in ("", "0"):
        return 0
    if not (_fast_math(q) and spec.ssa and head_block <= 64):
        return 0
    return {torch.bfloat16: 3, torch.float16: 4}.get(q.dtype, 0)


def _common_consts(q, spec: AttentionSpec, mask_kind, dv=None):
    d = q.shape[-1]
    even = _head_block(d) == d and (dv is None or _head_block(dv) == dv)
    return dict(
        SSA=spec.ssa, CAUSAL=spec.causal, MASK_KIND=mask_kind,
        BLOCK_D=_head_block(d), EVEN_D=even, ACC=_acc_dtype(q.dtype), DOT_PRECISION="ieee",
        FAST_MATH=_fast_math(q),
    )


def _stat_tensor(q):
    B, H, Lq, _ = q.shape
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty((B, H, Lq), device=q.device, dtype=dtype)


def row_entropy(q, k, mask, b, n, spec: AttentionSpec):
    """Entropy and log-sum-exp of ``softmax(l)`` per row, each ``(B, Hq, Lq)``, O(L) memory."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    _check_offsets(q, k)
    ent, lse_l = _stat_tensor(q), _stat_tensor(q)
    mask_t, mask_kind, ms = _mask_args(mask, q)
    ssa_b = b if spec.ssa else q
    ssa_n = n if spec.ssa else q
    consts = _common_consts(q, spec, mask_kind)
    feat_args, feat_consts = _feature_args(q, Lq, Lk, spec)
    consts["WINDOW"] = feat_consts["WINDOW"]  # dropout acts after the statistics

    def args(blk):
        return (q, k, ent, lse_l, ssa_b, ssa_n, mask_t, *q.stride(), *k.stride(), *ms,
                H, Lq, Lk, D, spec.group, triton.cdiv(Lq, blk.m), *_split_scale(spec.scale),
                *feat_args[4:])

    _launch(row_entropy_kernel, "stats", lambda blk: (triton.cdiv(Lq, blk.m) * B * H,), args, consts,
            q.device, consts["BLOCK_D"], q.dtype)
    return ent, lse_l


def forward(q, k, v, mask, b, n, beta, spec: AttentionSpec):
    """Output ``(B, Hq, Lq, Dv)`` in q's dtype and natural-log LSE ``(B, Hq, Lq)`` of ``beta * l``."""
    B, H, Lq, D = q.shape
    Lk, DV = k.shape[2], v.shape[3]
    _check_offsets(q, k, v)
    o = torch.empty((B, H, Lq, DV), device=q.device, dtype=q.dtype)
    lse = _stat_tensor(q)
    mask_t, mask_kind, ms = _mask_args(mask, q)
    consts = _common_consts(q, spec, mask_kind, DV)
    consts.update(ADAPTIVE=spec.adaptive, BLOCK_DV=_head_block(DV),
                  POLY_EXP2=_poly_exp2_degree(q, spec, max(consts["BLOCK_D"], _head_block(DV)), "fwd"))
    feat_args, feat_consts = _feature_args(q, Lq, Lk, spec)
    consts.update(feat_consts)

    def args(blk):
        return (q, k, v, o, lse, beta if spec.adaptive else q, b if spec.ssa else q,
                n if spec.ssa else q, mask_t,
                *q.stride(), *k.stride(), *v.stride(), *o.stride(), *ms,
                H, Lq, Lk, D, DV, spec.group, triton.cdiv(Lq, blk.m), *_split_scale(spec.scale),
                *feat_args)

    _launch(attention_fwd_kernel, "fwd", lambda blk: (triton.cdiv(Lq, blk.m) * B * H,), args, consts,
            q.device, max(consts["BLOCK_D"], consts["BLOCK_DV"]), q.dtype)
    return o, lse


def backward(do, q, k, v, o, lse, dlse, mask, b, n, temp: Optional[TemperatureState],
             spec: AttentionSpec, *, g: Optional[torch.Tensor] = None, dbeta_only: bool = False):
    """Gradients ``(dq, dk, dv, db, dn)``; ``db``, ``dn`` are ``(Hq,)`` or None for softmax.

    ``dlse`` (or None) is the gradient reaching the returned LSE: since ``d lse_i / d S'_ij = P'_ij``
    it only shifts ``delta`` (``delta_i = rowsum(dO_i * O_i) - dlse_i``).

    For callers holding a shard of the keys (adaptive only; see :func:`row_dbeta`): ``g``
    ``(B, Hq, Lq)`` is the temperature gradient ``g_i = dbeta_i * dbeta/dH_i`` of whole rows, used
    instead of the one computed from the keys given; ``dbeta_only`` runs the dQ kernel alone and
    returns its ``g`` (``temp.dbeta_dh`` of ones makes that the partial ``dbeta``).
    """
    B, H, Lq, D = q.shape
    HKV, Lk, DV = k.shape[1], k.shape[2], v.shape[3]
    _check_offsets(do, o)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    delta = _stat_tensor(q)
    lse2 = _stat_tensor(q)  # the LSE in base 2, -inf (empty rows) as 0: written by the dQ kernel
    acc_torch = delta.dtype
    mask_t, mask_kind, ms = _mask_args(mask, q)
    consts = _common_consts(q, spec, mask_kind, DV)
    consts.update(ADAPTIVE=spec.adaptive, BLOCK_DV=_head_block(DV))
    feat_args, feat_consts = _feature_args(q, Lq, Lk, spec)
    consts.update(feat_consts)
    head_block = max(consts["BLOCK_D"], consts["BLOCK_DV"])
    consts.update(POLY_EXP2=_poly_exp2_degree(q, spec, head_block, "bwd_dkdv"))
    if spec.adaptive:
        beta, lse_l, ent, dbeta_dh = temp
        g_given = g is not None
        g = _stat_tensor(q) if g is None else g.to(acc_torch).contiguous()
    else:
        g_given = False
        if g is not None or dbeta_only:
            raise ValueError("g and dbeta_only are for the adaptive temperature only")
        beta = lse_l = ent = dbeta_dh = g = q
    ssa_b = b if spec.ssa else q
    ssa_n = n if spec.ssa else q
    scale_args = _split_scale(spec.scale)
    parts = {}

    def dq_args(blk):
        num_m = triton.cdiv(Lq, blk.m)
        if spec.ssa:
            parts["db"] = torch.empty((B * H * num_m,), device=q.device, dtype=acc_torch)
            parts["dn"] = torch.empty((B * H * num_m,), device=q.device, dtype=acc_torch)
        db_part = parts.get("db", q)
        dn_part = parts.get("dn", q)
        return (q, k, v, o, do, lse, dlse if dlse is not None else q, dq, delta, lse2, beta, lse_l, ent, dbeta_dh, g,
                ssa_b, ssa_n, db_part, dn_part, mask_t,
                *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(), *dq.stride(), *ms,
                H, Lq, Lk, D, DV, spec.group, num_m, *scale_args, *feat_args)

    dq_consts = dict(consts, HAS_DLSE=dlse is not None,
                     POLY_EXP2=_poly_exp2_degree(q, spec, head_block, "bwd_dq"))
    if g_given:  # only then: the default specialisations' constexprs stay as they were
        dq_consts["G_GIVEN"] = True
    _launch(attention_bwd_dq_kernel, "bwd_dq", lambda blk: (triton.cdiv(Lq, blk.m) * B * H,), dq_args,
            dq_consts, q.device, head_block, q.dtype)
    if dbeta_only:
        return g

    def dkdv_args(blk):
        return (q, k, v, do, lse2, delta, dk, dv, beta, lse_l, ent, g, ssa_b, ssa_n, mask_t,
                *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *ms,
                H, HKV, Lq, Lk, D, DV, spec.group, triton.cdiv(Lk, blk.n), *scale_args, *feat_args)

    _launch(attention_bwd_dkdv_kernel, "bwd_dkdv", lambda blk: (triton.cdiv(Lk, blk.n) * B * HKV,),
            dkdv_args, consts, q.device, head_block, q.dtype)
    db = dn = None
    if spec.ssa:
        db = parts["db"].view(B, H, -1).sum(dim=(0, 2))
        dn = parts["dn"].view(B, H, -1).sum(dim=(0, 2))
    return dq, dk, dv, db, dn


def row_dbeta(do, q, k, v, o, lse, dlse, mask, b, n, temp: TemperatureState, spec: AttentionSpec):
    """``dbeta_i = sum_j dS'_ij l_ij`` ``(B, Hq, Lq)`` over the keys given (adaptive only), for a
    caller holding a shard of the keys: ``o``, ``lse`` and ``temp`` are those of whole rows, so
    the shards' results sum to the whole row's ``dbeta``. One launch of the dQ kernel with
    ``dbeta/dH = 1`` (its other outputs are discarded)."""
    if not spec.adaptive:
        raise ValueError("row_dbeta is for the adaptive temperature only")
    ones = TemperatureState(temp.beta, temp.lse_l, temp.entropy, torch.ones_like(temp.dbeta_dh))
    return backward(do, q, k, v, o, lse, dlse, mask, b, n, ones, spec, dbeta_only=True)


def dropout_mask(rng: torch.Tensor, shape, dropout_p: float) -> torch.Tensor:
    """The keep-mask ``(B, H, Lq, Lk)`` (bool, on ``rng``'s device) that the attention kernels
    apply for the ``(seed, offset)`` tensor ``rng`` and ``dropout_p``, materialised by a kernel that
    calls the same ``common.dropout_keep`` on tiles of its own size. For tests and inspection."""
    B, H, Lq, Lk = (int(x) for x in shape)
    out = torch.empty((B, H, Lq, Lk), device=rng.device, dtype=torch.uint8)
    if out.numel() == 0:
        return out.bool()
    # tiles unlike any attention kernel's (which use 16 x 16 under the interpreter)
    bm, bn = (32, 64) if _device_arch(rng.device) is None else (64, 128)
    num_m, num_n = triton.cdiv(Lq, bm), triton.cdiv(Lk, bn)
    dropout_mask_kernel[(num_m * num_n * B * H,)](
        out, rng, keep_threshold(float(dropout_p)), H, Lq, Lk, *out.stride(), num_m, num_n,
        BLOCK_M=bm, BLOCK_N=bn, FAST_MATH=_device_arch(rng.device) is not None)
    return out.bool()
