"""The attention kernels' arguments, encoded from a call: constexprs shared by every kernel of a
call (:func:`common_consts`), the scale split for the kernels' two-float product, masks (and a
boolean mask made additive where that is faster), the feature arguments (dropout, window), the
logit arguments (sinks, soft-capping), the fast-math switches, and the positional argument
tuples the kernels' signatures take (:data:`PARAMS`, :func:`positional`)."""
from __future__ import annotations

import inspect
import os
from typing import Optional

import numpy as np
import torch
import triton.language as tl

from ..conventions import dropout_keep_threshold, dropout_scale, kernel_window
from ..spec import AttentionSpec
from . import block_choice
from .backward import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel
from .forward import attention_fwd_kernel
from .interpreter import environ_get, interpreting
from .logits import poly_exp2_pays
from .masks import MASK_ADD, MASK_BOOL, MASK_NONE
from .row_entropy import row_entropy_kernel
from .tiles import next_pow2 as _next_pow2



# Tests set this to 3 or 4 to run the polynomial exp2 under the interpreter (see below).
FORCE_POLY_EXP2: Optional[int] = None


def acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def head_block_of(d: int) -> int:
    return max(16, _next_pow2(d))


def check_offsets(*tensors):
    """Kernels index (batch, head) slices with int64 and positions inside one slice with int32."""
    for t in tensors:
        if t.is_contiguous() and t.numel() < 2**31:  # then no slice spans 2^31 (the common case, cheap)
            continue
        span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape[2:], t.stride()[2:]))
        if span >= 2**31:
            raise ValueError(f"ssa_flash: one (batch, head) slice of a tensor of shape {tuple(t.shape)} "
                             f"and strides {t.stride()} spans {span} elements; the Triton kernels "
                             "support up to 2^31 per slice (make the tensor contiguous)")


def _split_scale(scale: float):
    """Python floats reach kernels as float32: pass the scale as float32 head + remainder."""
    hi = float(np.float32(scale))
    return hi, float(np.float32(scale - hi))


def scale_args(scale: float) -> dict:
    """The softmax scale's kernel argument ``scale = (hi, lo)`` (:func:`_split_scale`)."""
    return dict(scale=_split_scale(scale))


def bool_mask_as_additive(like: torch.Tensor) -> bool:
    """Whether a boolean mask reaches compiled float64 kernels as an additive one (0 / -inf).

    Triton 3.6 cannot compile a float64 ``tl.dot`` whose operand is computed from 8-bit data (the
    boolean mask's bytes feed the probabilities of the second matmul): its MMA lowering takes the
    narrowest type on the operand's chain for the k-width and asserts "fp64 don't support largeK
    MMA" (seen on an H200, 2026-11-26). float64 is the dtype of gradient checks, where a float mask's
    8 bytes per element cost nothing that matters; the interpreter has no such limit."""
    return like.dtype == torch.float64 and like.device.type == "cuda" and not interpreting()


def additive_from_bool(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (bool, True = attend) as a float64 additive mask, 0 where True and -inf where False,
    with the same broadcast (stride-0) dimensions: a row with no True stays a row of -inf, which the
    kernels treat as they treat an empty boolean row."""
    base = mask[tuple(slice(0, 1) if st == 0 else slice(None) for st in mask.stride())]
    return torch.zeros(base.shape, dtype=torch.float64, device=mask.device).masked_fill_(
        ~base, float("-inf")).expand(mask.shape)


def mask_args(mask: Optional[torch.Tensor], like: torch.Tensor):
    """``(MASK=..., mask_strides=...)`` kernel arguments and the ``MASK_KIND`` of ``mask``."""
    if mask is None:
        return dict(MASK=like, mask_strides=(0, 0, 0, 0)), MASK_NONE
    if mask.dtype == torch.bool and bool_mask_as_additive(like):
        mask = additive_from_bool(mask)
    if mask.dtype == torch.bool:  # bytes: kernels read 0 / non-zero, not i1 pointers
        return dict(MASK=mask.view(torch.uint8), mask_strides=strides_of(mask)), MASK_BOOL
    return dict(MASK=mask, mask_strides=strides_of(mask)), MASK_ADD


def strides_of(t: torch.Tensor) -> tuple:
    """A 4-D tensor's strides as the kernels take them, one tuple argument ``(batch, head, row,
    column)``. Triton specialises each element as it would a scalar argument (1: a constant;
    a multiple of 16: known divisible), so unit strides still compile to contiguous accesses."""
    return tuple(int(st) for st in t.stride())


def _runtime_params(kernel) -> tuple:
    """Names of ``kernel``'s parameters that are not ``tl.constexpr``, in signature order."""
    params = inspect.signature(getattr(kernel, "fn", kernel)).parameters.values()
    return tuple(p.name for p in params if p.annotation is not tl.constexpr and p.annotation != "tl.constexpr")


# The attention kernels' runtime parameters by launch name, read from their definitions once (tests
# replace the kernels the launcher calls by stand-ins; the arguments follow the definitions).
PARAMS = {"fwd": _runtime_params(attention_fwd_kernel), "row_entropy": _runtime_params(row_entropy_kernel),
           "bwd_dq": _runtime_params(attention_bwd_dq_kernel), "bwd_dkdv": _runtime_params(attention_bwd_dkdv_kernel)}


def positional(kernel: str, **named) -> tuple:
    """The runtime arguments of attention kernel ``kernel`` (``"fwd"``, ``"row_entropy"``,
    ``"bwd_dq"``, ``"bwd_dkdv"``) in signature order, from their names: launch sites name every
    argument, and one the kernel does not take or one left out is an error here rather than a
    misplaced argument. Related arguments travel as one tuple (strides, the split scale, the
    dropout and window parameters; Triton >= 3.3); :class:`KernelLaunch` records the positional
    tuple."""
    names = PARAMS[kernel]
    if len(named) == len(names):
        try:
            return tuple([named[n] for n in names])
        except KeyError:
            pass
    unknown = set(named) - set(names)
    missing = [n for n in names if n not in named]
    raise TypeError(f"ssa_flash: {kernel} kernel: unknown arguments {sorted(unknown)}, missing {missing}")


def _fast_math(q) -> bool:
    """Hardware approximations (``lg2.approx``, ``rcp.approx``) on a GPU in float32 accumulation;
    the interpreter runs exact maths (it cannot run inline PTX)."""
    on_gpu = block_choice.pretended_arch() is not None or (q.device.type == "cuda" and not interpreting())
    return on_gpu and q.dtype != torch.float64


def feature_args(q, Lq: int, Lk: int, spec: AttentionSpec):
    """The feature arguments of the attention kernels by name, ``dropout = (RNG, keep31,
    drop_scale_hi, drop_scale_lo)`` and ``window = (left, right)``, and their ``DROPOUT`` /
    ``WINDOW`` constexprs. Without dropout or a window they are None, which Triton turns into
    constants: the kernels then take exactly the parameters they take without these features. The
    window is :func:`ssa_flash.conventions.kernel_window`'s."""
    dropout = spec.dropout_p > 0.0
    drop_args = None
    if dropout:
        if spec.dropout_rng is None:
            raise ValueError("ssa_flash: dropout_p > 0 needs the (seed, offset) tensor spec.dropout_rng")
        p = float(spec.dropout_p)
        hi, lo = _split_scale(dropout_scale(p))
        drop_args = (spec.dropout_rng, dropout_keep_threshold(p), hi, lo)
    window = kernel_window(spec.window_left, spec.window_right, spec.causal, Lq, Lk)
    return dict(dropout=drop_args, window=window), dict(DROPOUT=dropout, WINDOW=window is not None)


def logit_args(spec: AttentionSpec, sinks: Optional[torch.Tensor], acc: torch.dtype):
    """The attention kernels' ``sinks`` and ``softcap = (hi, lo)`` arguments and their ``SINKS`` /
    ``SOFTCAP`` constexprs, which appear only when on: without a sink or a cap the arguments are
    None (constants to Triton) and the constexprs those of the kernels' defaults, so such calls
    compile exactly the kernels they compiled before these features existed."""
    args = dict(sinks=None, softcap=None)
    consts = {}
    if sinks is not None:
        args["sinks"] = sinks.to(acc).contiguous()
        consts["SINKS"] = True
    if spec.softcap > 0:
        args["softcap"] = _split_scale(float(spec.softcap))
        consts["SOFTCAP"] = True
    return args, consts


def poly_exp2_degree(q, score: int, head_block: int, kernel: str) -> int:
    """Degree of the polynomial ``exp2`` (``fast_math.exp2_poly``) that computes half of the interior
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
    measurement should decide. Which score functions qualify: ``logits.poly_exp2_pays``."""
    if FORCE_POLY_EXP2 is not None:
        return FORCE_POLY_EXP2
    if not (poly_exp2_pays(score) and head_block <= 64 and _fast_math(q)):
        return 0
    if kernel != "bwd_dkdv" and environ_get("SSA_FLASH_POLY_EXP2", "0") in ("", "0"):
        return 0
    return {torch.bfloat16: 3, torch.float16: 4}.get(q.dtype, 0)


def tf32_allowed() -> bool:
    """Whether torch's own float32 matmuls on CUDA may use TF32 tensor cores: True after
    ``torch.set_float32_matmul_precision("high")`` or ``("medium")`` or
    ``torch.backends.cuda.matmul.allow_tf32 = True`` (torch keeps the two in step); False at
    torch's default, ``"highest"``."""
    if _cublas_tf32 is not None and _matmul_precision is not None:  # the same two answers, one C call each
        return bool(_cublas_tf32()) or _matmul_precision() != "highest"
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


# what torch.backends.cuda.matmul.allow_tf32 (a Python __getattr__) and
# torch.get_float32_matmul_precision (a Python function) read
_cublas_tf32 = getattr(torch._C, "_get_cublas_allow_tf32", None)
_matmul_precision = getattr(torch._C, "_get_float32_matmul_precision", None)


def dot_precision(dtype: torch.dtype, arch: Optional[int]) -> str:
    """``input_precision`` of the kernels' ``tl.dot`` (the ``DOT_PRECISION`` constexpr, so a change
    of torch's setting compiles and caches another kernel): ``"tf32"`` for float32 inputs on a
    GPU with TF32 tensor cores (sm_80+) when :func:`tf32_allowed`, as torch's float32 matmuls do;
    ``"ieee"`` otherwise (float32 at ``"highest"``, 16-bit inputs, which the precision does not
    affect, float64, the interpreter). Read on the host at every call, outside any graph."""
    if dtype != torch.float32 or arch is None or arch < 80:
        return "ieee"
    return "tf32" if tf32_allowed() else "ieee"


_common: dict = {}


def common_consts(q, spec: AttentionSpec, score: int, mask_kind, dv=None):
    """The constexprs every attention kernel takes (a new dict each call: callers add theirs),
    kept per what decides them."""
    d = q.shape[-1]
    arch = block_choice.device_arch(q.device)
    tf32 = q.dtype == torch.float32 and tf32_allowed()
    # arch decides FAST_MATH too: None exactly where the interpreter runs (see _fast_math)
    key = (q.dtype, q.device.type, arch, d, dv, score, spec.causal, mask_kind, tf32)
    consts = _common.get(key)
    if consts is None:
        even = head_block_of(d) == d and (dv is None or head_block_of(dv) == dv)
        consts = _common[key] = dict(
            SCORE=score.id, CAUSAL=spec.causal, MASK_KIND=mask_kind,
            BLOCK_D=head_block_of(d), EVEN_D=even, ACC=acc_dtype(q.dtype),
            DOT_PRECISION=dot_precision(q.dtype, arch), FAST_MATH=_fast_math(q),
        )
    return dict(consts)


# Rows whose length is not a multiple of 8 elements (odd head dims such as 59 or 111) cannot be
# loaded as 16-byte vectors: every element goes through registers on its own and the main loops
# spill at any useful tile size (static audit: 200-900 B per thread at D=111 on sm_80 and sm_90,
# even with 32 x 32 tiles). Like FlashAttention, the host functions below zero-pad such head
# dims to the next multiple of 8 (an O(L D) copy next to O(L^2 D) work; zero columns change
# neither q . k nor the kept columns of the output) and slice the results. Not for a KV cache:
# there the copy would be as large as the decoding step's own reads.
HEAD_DIM_ALIGN = 8


def pad_head(x):
    pad = (-x.shape[-1]) % HEAD_DIM_ALIGN
    return torch.nn.functional.pad(x, (0, pad)) if pad else x
