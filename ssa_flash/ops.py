"""Public functions: argument validation, the choice of backend, then the custom ops.

Positional arguments are those of ``torch.nn.functional.scaled_dot_product_attention``, so each
function is a drop-in at an SDPA call site. Validation looks at shapes, dtypes, devices and
Python values, and at the values of CPU tensors (``b``, ``n``, ``cu_seqlens_*``,
``cache_seqlens``); it never reads tensor data from a GPU (no device synchronisation), so
there values outside the documented ranges are not caught.

The top layer (see ``ssa_flash.backends``): every call runs through ``ssa_flash.autograd``'s
custom ops and the backend interface (``ssa_flash.spec.Backend``), whichever the backend; inputs
with no rows, keys or head dim, where kernels launch nothing, go to the reference backend.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _nested, _shapes, autograd, backends, scores
from .spec import AttentionSpec, PlanMismatch, draw_dropout_rng
from .errors import BackendUnavailableError
from .conventions import DEFAULT_POLY, DEFAULT_THRESHOLD, NO_WINDOW

_log = logging.getLogger("ssa_flash")
_fallbacks_logged: set = set()

__all__ = [
    "attention",
    "ssa_attention",
    "softmax_attention",
    "adaptive_temperature_attention",
    "attention_entropy",
    "varlen_attention",
    "attention_with_kvcache",
    "dropout_mask",
    "available_backends",
    "BackendUnavailableError",
]

BACKENDS = ("auto", "triton", "cuda", "reference")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

Scalar = Union[float, Tensor]

try:  # numpy is optional (torch does not require it)
    import numpy as _numpy

    _NUMPY_BOOL: tuple = (_numpy.bool_,)
except ImportError:  # pragma: no cover
    _NUMPY_BOOL = ()


# --------------------------------------------------------------------------------------------
# Validation


def _type_name(x) -> str:
    """``x``'s type as a user would write it: ``int``, ``numpy.bool``, ``torch.Tensor``."""
    t = type(x)
    module = t.__module__
    if module == "builtins":
        return t.__qualname__
    if module.startswith("numpy"):
        module = "numpy"  # numpy.bool_, not numpy._core.multiarray... (numpy's own spelling)
    elif module.startswith("torch"):
        module = "torch"
    return f"{module}.{t.__qualname__}"


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_type_name(x)}")


def _is_numpy_bool(x) -> bool:
    # numpy.bool_ (numpy.bool in numpy 2) is no subclass of bool; an isinstance test (rather than
    # a look at the type's module name) is what torch.compile can trace
    return isinstance(x, _NUMPY_BOOL)


def _check_bool(name: str, x) -> bool:
    """``x`` as a Python bool: a bool or a numpy bool (what ``np.any``, comparisons of numpy scalars
    and config files parsed into numpy give). Ints (``1``, ``0``) are refused: a flag given an int
    is more often a misplaced positional argument than a truth value."""
    if isinstance(x, bool):
        return x
    if _is_numpy_bool(x):
        return bool(x)
    raise TypeError(f"{name} must be a bool, got {_type_name(x)}")


def _check_qkv(query, key, value, enable_gqa: bool, *, names=("query", "key", "value"),
               dims: str = "4 dims (B, H, L, D) or 3 (H, L, D)") -> int:
    """Validates the three inputs (4-D each); returns the GQA group size ``Hq // Hkv``. ``names``:
    the arguments as the caller calls them (``k_cache``, ``v_cache`` for a KV cache), ``dims``
    the layouts the caller accepts, for the messages."""
    qn, kn, vn = names
    for name, x in zip(names, (query, key, value)):
        _check_tensor(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must have {dims}, got shape {tuple(x.shape)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"{qn}, {kn} and {vn} must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if key.device != query.device or value.device != query.device:
        raise ValueError(f"{qn}, {kn} and {vn} must be on one device, got {query.device}, {key.device}, {value.device}")
    B, Hq, Lq, D = query.shape
    if key.shape[0] != B or value.shape[0] != B:
        raise ValueError(f"batch sizes differ: {qn} {B}, {kn} {key.shape[0]}, {vn} {value.shape[0]}")
    if key.shape[-1] != D:
        raise ValueError(f"{kn}'s head dim {key.shape[-1]} must equal {qn}'s {D}")
    if value.shape[1] != key.shape[1] or value.shape[2] != key.shape[2]:
        raise ValueError(f"{kn} {tuple(key.shape)} and {vn} {tuple(value.shape)} must agree in heads and length")
    Hkv = key.shape[1]
    if Hq == Hkv:
        return 1
    if not enable_gqa:
        raise ValueError(f"{qn} has {Hq} heads but {kn}/{vn} have {Hkv}: pass enable_gqa=True for grouped-query attention")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"enable_gqa needs {qn} heads ({Hq}) to be a multiple of {kn}/{vn} heads ({Hkv})")
    return Hq // Hkv


def _check_mask(attn_mask, query: Tensor, key: Tensor) -> Optional[Tensor]:
    """Returns the mask expanded (a view, no copy) to (B, Hq, Lq, Lk), or None."""
    if attn_mask is None:
        return None
    _check_tensor("attn_mask", attn_mask)
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = attend) or floating (added to the logits), got {attn_mask.dtype}")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
    full = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if attn_mask.dim() > 4:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} has more than 4 dims")
    try:
        if torch.broadcast_shapes(attn_mask.shape, full) != torch.Size(full):
            raise RuntimeError
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, Hq, Lq, Lk) = {full}") from None
    # (a mask that requires grad: the expand is part of the graph, so autograd sums the gradient
    # over the broadcast dims back to the mask's shape; _check_mask_grad says which backends)
    return attn_mask.expand(full)


def _learned_mask(mask: Optional[Tensor]) -> bool:
    """Whether ``mask`` is a float mask whose gradient this call must compute (a learned bias)."""
    return mask is not None and mask.requires_grad and torch.is_grad_enabled()


def _check_mask_grad(mask: Optional[Tensor], backend: str) -> None:
    """A float mask that requires grad (a learned additive bias) is differentiable on the
    reference backend (its explicit backward), on Triton and on the CUDA C++
    backend (its gradient reduced over the broadcast dims inside a kernel,
    ``ssa_flash/triton/mask_grad.py``, ``csrc/mask_grad.h``); any other backend: ``ValueError``
    naming it rather than a silent zero."""
    if _learned_mask(mask) and backend not in autograd.LEARNED_MASK_BACKENDS:
        raise ValueError(f"attn_mask requires grad: the {backend!r} backend does not compute gradients with "
                         "respect to attn_mask yet; backend='triton', 'cuda' or 'reference' does (docs/support.md)")


def _check_number(name: str, x, *, positive: bool = False) -> float:
    if type(x) is not float and type(x) is not int and (
            isinstance(x, bool) or _is_numpy_bool(x) or not isinstance(x, numbers.Real)):
        raise TypeError(f"{name} must be a real number, got {_type_name(x)}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    if positive and x <= 0:
        raise ValueError(f"{name} must be > 0, got {x}")
    return x


def _check_common(dropout_p, is_causal, scale, head_dim: int, return_lse) -> float:
    """Checks ``dropout_p``, the two flags and ``scale``; returns the scale (callers that keep the
    flags convert them with :func:`_check_bool` first, so that numpy bools become bools)."""
    dropout_p = _check_number("dropout_p", dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    _check_bool("is_causal", is_causal)
    _check_bool("return_lse", return_lse)
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    return _check_number("scale", scale)


_NO_WINDOW = (NO_WINDOW, NO_WINDOW)


def _check_window(window_size) -> Tuple[int, int]:
    """``window_size``: a pair ``(left, right)`` of ints >= -1 (``NO_WINDOW``, -1: that side
    unbounded)."""
    if window_size == _NO_WINDOW and type(window_size) is tuple:  # the default, checked cheaply
        return _NO_WINDOW
    if isinstance(window_size, (str, bytes)) or not isinstance(window_size, Sequence):
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {type(window_size).__name__}")
    if len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {len(window_size)} values")
    out = []
    for side, x in zip(("left", "right"), window_size):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"window_size {side} must be an int, got {type(x).__name__}")
        if x < NO_WINDOW:
            raise ValueError(f"window_size {side} must be >= -1 (-1: unbounded), got {x}")
        out.append(int(x))
    return out[0], out[1]


def _effective_window(window: Tuple[int, int], lq: int, lk: int, is_causal: bool) -> Tuple[int, int]:
    """The window with every side that excludes nothing made ``NO_WINDOW``: ``left >= Lq - 1``
    (then ``i - left <= 0``), ``right >= Lk - 1``, or ``right`` under ``is_causal`` (``j <= i`` is
    tighter). Both ``NO_WINDOW``: no window, and the kernels compile without one
    (``ssa_flash.conventions.kernel_window``)."""
    left, right = window
    if left >= max(lq - 1, 0):
        left = NO_WINDOW
    if right >= max(lk - 1, 0) or (is_causal and right >= 0):
        right = NO_WINDOW
    return left, right


def _check_head_param(name: str, x, heads: int, like: Tensor, rule: str) -> Tensor:
    """A score function's parameter (``b``, ``n``, ...): a finite number or a tensor of shape () or
    (Hq,) of finite values obeying ``rule`` (``"> 0"`` or ``">= 0"``, from ``ssa_flash.scores``;
    SSA: ``b > 0`` and ``n >= 0``), one rule for numbers and tensors. (``b <= 0`` leaves the maths' domain:
    ``log1p(b |z|)`` is NaN for ``b |z| <= -1``. ``n = 0`` is the degenerate end of SSA, uniform
    weights over the admissible keys, which the kernels compute with finite gradients ``dn``, so
    a learnable ``n`` may pass through it; ``n < 0`` would rank keys backwards and is refused.
    The paper's ``n >= 1`` is a modelling choice that :class:`ssa_flash.nn.SSAttention`
    enforces.) Returns (Hq,) in the accumulation dtype, differentiable with respect to the
    caller's tensor.

    A tensor's values are checked wherever reading them is free: CPU tensors, whether they
    require grad or not. CUDA tensors are not read (that would synchronise the device on every
    call), nor is anything while torch.compile traces (a data-dependent branch would break the
    graph): there, values outside the domain give NaN or meaningless weights, not an error."""
    positive = rule == "> 0"
    acc = torch.float64 if like.dtype == torch.float64 else torch.float32
    if isinstance(x, Tensor):
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
        if x.dim() > 1 or (x.dim() == 1 and x.shape[0] != heads):
            raise ValueError(f"{name} must be a number or a tensor of shape () or ({heads},) (one per query head), got {tuple(x.shape)}")
        if x.device != like.device:
            raise ValueError(f"{name} is on {x.device} but query is on {like.device}")
        # Reads the values, so only where that costs no device sync (CPU) and not while
        # torch.compile traces (a data-dependent branch would break the graph). A tensor that
        # requires grad is checked too (detached: the check is no part of the graph).
        if x.device.type == "cpu" and not torch.compiler.is_compiling():
            values = x.detach()
            outside = values <= 0 if positive else values < 0
            if bool(outside.any() | ~torch.isfinite(values).all()):
                raise ValueError(f"{name} must be finite and {rule} for every head, got {values.tolist()}")
        return x.to(acc).expand(heads).contiguous()
    value = _check_number(name, x)
    if (value <= 0) if positive else (value < 0):
        raise ValueError(f"{name} must be {rule}, got {value}")
    return _constant_heads(value, heads, acc, like.device)


_constants: dict = {}
_MAX_CONSTANTS = 256


def _constant_heads(value: float, heads: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(heads,)`` filled with ``value``: a per-head parameter given as a number. Kept per value,
    shape, dtype and device (a fill is a kernel launch on a GPU, ~5 us of host time per call);
    the kernels only read it and it never requires grad. Not kept while a CUDA graph captures
    (a fill recorded there has not run yet) or torch.compile traces (a graph makes its own)."""
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.full((heads,), value, dtype=dtype, device=device)
    key = (value, heads, dtype, device)
    t = _constants.get(key)
    if t is None:
        if len(_constants) >= _MAX_CONSTANTS:
            _constants.clear()
        t = _constants[key] = torch.full((heads,), value, dtype=dtype, device=device)
    return t


def _check_softcap(softcap) -> float:
    """``softcap``: a finite real number >= 0 (0: no soft-capping), as a float."""
    value = _check_number("softcap", softcap)
    if value < 0:
        raise ValueError(f"softcap must be >= 0 (0: no soft-capping), got {value}")
    return value


def _check_sinks(sinks, heads: int, like: Tensor) -> Optional[Tensor]:
    """``sinks``: None, a real number, or a floating tensor of shape () or (Hq,) on the query's
    device (docs/design.md §1.6). Values may be any real number or ``-inf`` (that head has no
    sink); NaN and ``+inf`` are refused where the values can be read for free (numbers, CPU
    tensors outside torch.compile: see :func:`_check_head_param`). Returns None or (Hq,) in the
    accumulation dtype, differentiable with respect to the caller's tensor."""
    if sinks is None:
        return None
    acc = torch.float64 if like.dtype == torch.float64 else torch.float32
    if isinstance(sinks, Tensor):
        if not sinks.is_floating_point():
            raise TypeError(f"sinks must be a floating tensor, got {sinks.dtype}")
        if sinks.dim() > 1 or (sinks.dim() == 1 and sinks.shape[0] != heads):
            raise ValueError(f"sinks must be a number or a tensor of shape () or ({heads},) (one per query "
                             f"head), got {tuple(sinks.shape)}")
        if sinks.device != like.device:
            raise ValueError(f"sinks is on {sinks.device} but query is on {like.device}")
        if sinks.device.type == "cpu" and not torch.compiler.is_compiling():
            values = sinks.detach()
            if bool((torch.isnan(values) | (values == float("inf"))).any()):
                raise ValueError(f"sinks must be real numbers or -inf (no sink) for every head, got {values.tolist()}")
        return sinks.to(acc).expand(heads).contiguous()
    if isinstance(sinks, bool) or _is_numpy_bool(sinks) or not isinstance(sinks, numbers.Real):
        raise TypeError(f"sinks must be None, a real number or a floating tensor, got {_type_name(sinks)}")
    value = float(sinks)
    if math.isnan(value) or value == float("inf"):
        raise ValueError(f"sinks must be a real number or -inf (no sink), got {value}")
    return _constant_heads(value, heads, acc, like.device)


def _check_poly(poly, threshold) -> Tuple[Tuple[float, ...], float]:
    if poly is DEFAULT_POLY and threshold is DEFAULT_THRESHOLD:  # the defaults, checked cheaply
        return poly, threshold
    if isinstance(poly, (str, bytes)) or not isinstance(poly, Sequence) or len(poly) == 0:
        raise TypeError("poly must be a non-empty sequence of coefficients, highest degree first")
    poly = tuple(_check_number(f"poly[{i}]", c) for i, c in enumerate(poly))
    return poly, _check_number("threshold", threshold)


def _check_score(score, score_params, heads: int, like: Tensor) -> Tuple[scores.ScoreFunction, Tuple[Tensor, ...]]:
    """``score`` (a name in ``ssa_flash.scores.SCORES``, or a ``ScoreFunction``) and its parameters
    ``score_params`` (a mapping by parameter name, or a sequence in the registry's order; None for a
    function without parameters), each checked by :func:`_check_head_param` against its rule.
    Returns the function and its parameters as (Hq,) tensors in the accumulation dtype."""
    if isinstance(score, scores.ScoreFunction):
        f = score
    elif isinstance(score, str):
        f = scores.get(score)
    else:
        raise TypeError(f"score must be a str (one of {tuple(scores.SCORES)}), got {_type_name(score)}")
    if score_params is None:
        score_params = ()
    if isinstance(score_params, dict):
        unknown = [name for name in score_params if name not in f.params]
        missing = [name for name in f.params if name not in score_params]
        if unknown or missing:
            raise ValueError(f"score_params for score {f.name!r} must give {f.params}: "
                             f"missing {tuple(missing)}, unknown {tuple(unknown)}")
        values = tuple(score_params[name] for name in f.params)
    elif isinstance(score_params, (tuple, list)):
        if len(score_params) != len(f.params):
            raise ValueError(f"score {f.name!r} takes {len(f.params)} parameter(s) {f.params}, "
                             f"got {len(score_params)}")
        values = tuple(score_params)
    else:
        raise TypeError(f"score_params must be a dict by parameter name or a sequence, got {_type_name(score_params)}")
    return f, tuple(_check_head_param(name, x, heads, like, rule)
                    for name, rule, x in zip(f.params, f.rules, values))


def _check_variant(query: Tensor, score, score_params, adaptive: bool, poly, threshold, sinks, softcap):
    """The variant's parameters checked for ``query``'s heads: ``(score, params, poly, threshold,
    sinks, softcap)``: the score function and its parameters as (Hq,) tensors
    (:func:`_check_score`), the temperature polynomial (the defaults without the adaptive
    temperature), ``sinks`` None or (Hq,), ``softcap`` a float."""
    heads = query.shape[1]
    score, params = _check_score(score, score_params, heads, query)
    if adaptive:
        poly, threshold = _check_poly(poly, threshold)
    else:
        poly, threshold = DEFAULT_POLY, DEFAULT_THRESHOLD
    return score, params, poly, threshold, _check_sinks(sinks, heads, query), _check_softcap(softcap)


# --------------------------------------------------------------------------------------------
# Backends


def available_backends(device: Union[str, torch.device] = "cuda") -> Tuple[str, ...]:
    """The backends that can run on ``device`` in this process, in ``backend="auto"``'s order of
    preference. The CUDA C++ backend comes after Triton, and ``auto`` does not pick it, on an
    architecture where no GPU run has verified it (``ssa_flash.backends.cuda_backend.VERIFIED_ARCHS``,
    docs/cuda.md); ask for it with ``backend="cuda"``."""
    return backends.available(device)


def _supports(name: str, query: Tensor, key: Tensor, value: Tensor, spec: AttentionSpec,
              sinks: Optional[Tensor]) -> Optional[str]:
    """``backends.get(name).supports``; ``sinks`` is passed only when given, so that a call
    without sinks asks exactly what it asked before sinks existed."""
    if sinks is None:
        return backends.get(name).supports(query, key, value, spec)
    return backends.get(name).supports(query, key, value, spec, sinks)


def _sink_arg(sinks: Optional[Tensor]) -> dict:
    """``{"sinks": sinks}``, or nothing without sinks: a call without them reaches
    ``ssa_flash.autograd`` with exactly the arguments it had before sinks existed."""
    return {} if sinks is None else {"sinks": sinks}


def _log_reference_fallback(refusals) -> None:
    """Say once per reason that ``"auto"`` runs the reference on a GPU: it materialises the
    ``(B, H, Lq, Lk)`` scores (O(L^2) memory, no fused kernel), which a user should not meet
    silently."""
    key = tuple(refusals)
    if key not in _fallbacks_logged:
        _fallbacks_logged.add(key)
        _log.warning("backend='auto' runs the reference implementation (O(L^2) memory) on the GPU: %s",
                     "; ".join(refusals))


def _resolve_backend(backend, query: Tensor, key: Tensor, value: Tensor, spec: AttentionSpec,
                     sinks: Optional[Tensor] = None) -> str:
    """The backend that runs these inputs (``sinks``: the validated sink tensor, or None), or
    ``BackendUnavailableError`` saying why none can. ``"auto"``: the first of
    ``backends.resolve("auto")``'s choice and then ``backends.auto_candidates`` whose ``supports``
    accepts them (the reference accepts everything); a named backend that is unavailable or
    refuses them raises."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "reference":
        return backend
    if backend == "auto":
        first, _ = backends.resolve("auto", query.device, query.dtype)
        refusals = []
        for name in (first, *(c for c in backends.auto_candidates(query.device, query.dtype) if c != first)):
            why = _supports(name, query, key, value, spec, sinks)
            if why is None:
                if name == "reference" and refusals and query.device.type == "cuda":
                    _log_reference_fallback(refusals)
                return name
            refusals.append(f"{name}: {why}")
        raise BackendUnavailableError(f"backend='auto': no backend can run these inputs ({'; '.join(refusals)})")
    name, why = backends.resolve(backend, query.device, query.dtype)
    if why:
        raise BackendUnavailableError(f"backend={backend!r} is unavailable: {why}")
    why = _supports(name, query, key, value, spec, sinks)
    if why:
        raise BackendUnavailableError(f"backend={name!r} cannot run these inputs: {why}")
    return name


# --------------------------------------------------------------------------------------------
# Public functions


def _degenerate(query: Tensor, key: Tensor, value: Tensor, key_dim: int = 2) -> bool:
    """No query rows, keys (dim ``key_dim`` of ``key``), or head dim: the kernels launch nothing,
    the reference backend takes the call."""
    return query.numel() == 0 or key.shape[key_dim] == 0 or value.shape[-1] == 0


# one C call (~0.15 us) answers "no autocast anywhere" on the hot path (torch >= 2.4; else the
# per-device question below, ~0.5 us)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)




def _autocast_dtype(query) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` asks for on ``query``'s device type, or None when it is off
    (or ``query`` is no tensor: the checks then say so)."""
    if (_any_autocast is not None and not _any_autocast()) or not isinstance(query, Tensor):
        return None
    device_type = query.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _autocast(dtype: torch.dtype, *tensors):
    """SDPA's rule under ``torch.autocast``, for the attention inputs: floating-point tensors
    other than float64 in ``dtype`` (a cast autograd sees: gradients reach the originals in their
    own dtype). Masks, score parameters and sinks are left as they are (a float mask is added in
    float32 anyway; SDPA would round it to ``dtype``). The call then runs with autocast off, so
    that the reference's own matmuls are not cast behind its back."""
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)


# --------------------------------------------------------------------------------------------
# Call plans: a call whose arguments have the same types and values, and whose tensors the same
# metadata, as an earlier call's passes the same validation and picks the same backend. A
# training step's calls repeat their shapes, so what the checks derive (the group, scale,
# window, score function, constant parameters, spec, backend) is kept per such key and the
# checks run once; what depends on the tensors' values runs every call (a CPU parameter
# tensor's domain check, the dropout draw). Only for 4-D eager calls (no torch.compile tracing,
# no dispatch mode, plain tensors) with a kernel backend.

_MAX_CALL_PLANS = 1024
_call_plans: dict = {}


class _CallPlan:
    __slots__ = ("group", "scale", "dropout_p", "causal", "return_lse", "full", "score", "params", "sinks",
                 "spec", "backend", "heads", "prepared")


def _meta(t) -> tuple:
    """A tensor's metadata as the checks and the kernels' plans read it (its values are not
    read): the 16-byte alignment of its data too (the kernels are specialised on it)."""
    return (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() & 15)


def _value_key(x):
    """A tensor by its metadata (``"T"`` first: its values are checked per call), anything else by
    type and value (``1`` and ``True`` are different keys: the checks treat them apart)."""
    if isinstance(x, Tensor):
        return ("T", _meta(x))
    return (type(x), x)


def _call_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, score, score_params,
              adaptive, poly, threshold, backend, return_lse, deterministic, window_size, sinks, softcap):
    """The call-plan key of a call, or None where calls are not planned. (The hot path: each
    Python function it calls costs as much as the rest of a line, so the inputs' metadata and
    the parameters' keys are written out here rather than through :func:`_meta`.)"""
    if type(query) is not Tensor or type(key) is not Tensor or type(value) is not Tensor or query.dim() != 4:
        return None
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._are_functorch_transforms_active()):
        return None
    if attn_mask is not None and (type(attn_mask) is not Tensor or attn_mask.requires_grad):
        return None  # (a learned mask: _check_mask_grad's backend rule, unplanned)
    if score_params is None:
        pkey = None
    else:
        if type(score_params) is dict:
            items = score_params.items()
        elif type(score_params) is tuple or type(score_params) is list:
            items = enumerate(score_params)
        else:
            return None
        pkey = [type(score_params)]
        for name, x in items:
            pkey.append((name, ("T", _meta(x)) if isinstance(x, Tensor) else (type(x), x)))
        pkey = tuple(pkey)
    return ((query.shape, query.stride(), query.dtype, query.device, query.requires_grad, query.data_ptr() & 15),
            (key.shape, key.stride(), key.dtype, key.device, key.requires_grad, key.data_ptr() & 15),
            (value.shape, value.stride(), value.dtype, value.device, value.requires_grad, value.data_ptr() & 15),
            None if attn_mask is None else _meta(attn_mask),
            (type(dropout_p), dropout_p), (type(is_causal), is_causal), (type(scale), scale),
            (type(enable_gqa), enable_gqa), (type(score), score), pkey, (type(adaptive), adaptive),
            poly if poly is DEFAULT_POLY else (type(poly), tuple(poly) if type(poly) in (tuple, list) else poly),
            (type(threshold), threshold), (type(backend), backend), (type(return_lse), return_lse),
            (type(deterministic), deterministic),
            (type(window_size), tuple(window_size) if type(window_size) in (tuple, list) else window_size),
            None if sinks is None else _value_key(sinks), (type(softcap), softcap), torch.is_grad_enabled(),
            backends._state())


def _plan_call(call_key, group, scale, dropout_p, is_causal, return_lse, mask, score, params, sinks, spec,
               backend, query, key, value, score_params, sinks_arg) -> None:
    """Keep the plan of a call that validated and ran through ``backend``."""
    if query.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # the constant parameters made now are filled only when the graph replays
    plan = _CallPlan()
    plan.group, plan.scale, plan.dropout_p, plan.causal, plan.return_lse = group, scale, dropout_p, is_causal, return_lse
    plan.full = None if mask is None else tuple(mask.shape)
    plan.score, plan.backend, plan.heads = score, backend, query.shape[1]
    tensors_in = score_params is not None and any(
        isinstance(x, Tensor) for x in (score_params.values() if isinstance(score_params, dict) else score_params))
    plan.params = None if tensors_in else params  # tensors: checked and converted per call
    plan.sinks = None if isinstance(sinks_arg, Tensor) else (sinks,)
    plan.spec = spec if dropout_p == 0 else dataclasses.replace(spec, dropout_rng=None)
    # the backend's own work on this specialisation, done once (spec.Backend.prepare): for the
    # calls autograd.attention_prepared takes (plain tensors, no sinks)
    plan.prepared = None if sinks is not None else _prepare(backend, query, key, value, mask, params, spec)
    if len(_call_plans) >= _MAX_CALL_PLANS:
        _call_plans.clear()
    _call_plans[call_key] = plan


def _prepare(backend, query, key, value, mask, params, spec):
    """The backend's prepared call for a plan (``spec.Backend.prepare``; None where it makes none)."""
    prepare = getattr(backends.get(backend), "prepare", None)
    if prepare is None or torch._C._are_functorch_transforms_active():
        return None
    return prepare(query, key, value, mask, params, None, spec)


def _replay_call(plan: _CallPlan, query, key, value, attn_mask, score_params, sinks):
    """:func:`_attention` for a call whose checks a plan holds: through the backend's prepared
    call where it made one (which raises ``PlanMismatch``, nothing run, where it does not hold
    this call), else through ``autograd.attention``."""
    params = plan.params
    if params is None:
        params = _check_score(plan.score, score_params, plan.heads, query)[1]
    prepared = plan.prepared
    if prepared is None:
        sinks = plan.sinks[0] if plan.sinks is not None else _check_sinks(sinks, plan.heads, query)
    mask = None if attn_mask is None else attn_mask.expand(plan.full)
    spec = plan.spec
    if plan.dropout_p > 0:
        spec = dataclasses.replace(spec, dropout_rng=draw_dropout_rng(query.device))
    if prepared is not None:  # (made for calls without sinks only)
        try:
            out, lse = autograd.attention_prepared(prepared, query, key, value, params, mask, plan.backend, spec)
            return (out, lse) if plan.return_lse else out
        except PlanMismatch:
            # (nothing ran) a launcher switch or an alignment the prepared call was not made for:
            # this call through the backend's full path with the same spec, so with the dropout
            # seed already drawn (a second draw would move torch's generator), and the prepared
            # call made again for the next
            out, lse = autograd.attention(query, key, value, params, mask, plan.backend, spec)
            plan.prepared = _prepare(plan.backend, query, key, value, mask, params, spec)
            return (out, lse) if plan.return_lse else out
    out, lse = autograd.attention(query, key, value, params, mask, plan.backend, spec, **_sink_arg(sinks))
    return (out, lse) if plan.return_lse else out


def _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, score,
               score_params, adaptive, poly, threshold, backend, return_lse, deterministic, window_size, sinks,
               softcap):
    # (torch's function, not the C function it asks: torch.compile traces this one, not that)
    if deterministic is False and torch.are_deterministic_algorithms_enabled():
        deterministic = True  # torch.use_deterministic_algorithms(True): torch's own switch
    cast = None if _any_autocast is not None and not _any_autocast() else _autocast_dtype(query)
    if cast is not None:
        query, key, value = _autocast(cast, query, key, value)
        with torch.autocast(query.device.type, enabled=False):
            return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, score=score,
                              score_params=score_params, adaptive=adaptive, poly=poly, threshold=threshold,
                              backend=backend, return_lse=return_lse, deterministic=deterministic,
                              window_size=window_size, sinks=sinks, softcap=softcap)
    try:
        call_key = _call_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, score,
                             score_params, adaptive, poly, threshold, backend, return_lse, deterministic, window_size,
                             sinks, softcap)
        plan = None if call_key is None else _call_plans.get(call_key)
    except (TypeError, RuntimeError):  # an unhashable argument, a tensor without storage: checked below
        call_key = plan = None
    if plan is not None:
        return _replay_call(plan, query, key, value, attn_mask, score_params, sinks)
    # SDPA's other layouts, reached only when no call plan matched (a planned call pays nothing):
    # jagged nested tensors (ssa_flash._nested), other ranks and broadcast batch or head dims
    # (ssa_flash._shapes); both call back here with (B, H, L, D) tensors of one batch size
    if isinstance(query, Tensor) and isinstance(key, Tensor) and isinstance(value, Tensor) and (
            query.is_nested or key.is_nested or value.is_nested or query.dim() != 4 or key.dim() != 4
            or value.dim() != 4 or key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]
            or (key.shape[1] != query.shape[1] and not enable_gqa)):
        options = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, score=score, score_params=score_params,
                       adaptive=adaptive, poly=poly, threshold=threshold, backend=backend,
                       deterministic=deterministic, window_size=window_size, sinks=sinks, softcap=softcap)
        enable_gqa = _check_bool("enable_gqa", enable_gqa)
        if query.is_nested or key.is_nested or value.is_nested:
            return _nested.attention(varlen_attention, query, key, value, attn_mask, enable_gqa, return_lse,
                                     **options)
        return _shapes.attention(_attention, query, key, value, attn_mask, enable_gqa, return_lse, **options)
    score_arg, sinks_arg, backend_arg = score_params, sinks, backend
    enable_gqa = _check_bool("enable_gqa", enable_gqa)
    deterministic = _check_bool("deterministic", deterministic)
    adaptive = _check_bool("adaptive_temperature", adaptive)
    _check_tensor("query", query)
    unbatched = query.dim() == 3
    if unbatched:
        for name, x in (("key", key), ("value", value)):
            _check_tensor(name, x)
            if x.dim() != 3:
                raise ValueError(f"{name} must have 3 dims like query, got shape {tuple(x.shape)}")
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        if isinstance(attn_mask, Tensor) and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
    group = _check_qkv(query, key, value, enable_gqa)
    is_causal, return_lse = _check_bool("is_causal", is_causal), _check_bool("return_lse", return_lse)
    scale = _check_common(dropout_p, is_causal, scale, query.shape[-1], return_lse)
    dropout_p = float(dropout_p)
    left, right = _effective_window(_check_window(window_size), query.shape[2], key.shape[2], is_causal)
    mask = _check_mask(attn_mask, query, key)
    score, params, poly, threshold, sinks, softcap = _check_variant(query, score, score_params, adaptive, poly,
                                                                    threshold, sinks, softcap)
    # dropout bits: a (seed, offset) drawn from torch's generator for the device, on the device
    rng = draw_dropout_rng(query.device) if dropout_p > 0 else None
    spec = AttentionSpec(scale=scale, score=score.name, causal=is_causal, group=group, adaptive=adaptive, poly=poly,
                         threshold=threshold, deterministic=deterministic, dropout_p=dropout_p,
                         window_left=left, window_right=right, dropout_rng=rng, softcap=softcap)
    backend = _resolve_backend(backend, query, key, value, spec, sinks)
    if _degenerate(query, key, value):  # the kernels launch nothing: the reference backend's zeros
        out, lse = autograd.attention(query, key, value, params, mask, "reference", spec, **_sink_arg(sinks))
    elif mask is not None and mask.requires_grad and torch.is_grad_enabled():  # a learned mask (no call: hot path)
        _check_mask_grad(mask, backend)
        # (the 4-D mask of its own size: its gradient is reduced in the kernel)
        out, lse = autograd.attention_learned_mask(query, key, value, params, attn_mask[(None,) * (4 - attn_mask.dim())],
                                                   backend, spec, **_sink_arg(sinks))
    else:
        out, lse = autograd.attention(query, key, value, params, mask, backend, spec, **_sink_arg(sinks))
        if call_key is not None and backend_arg is not None and backend != "reference":  # (a plan saves it nothing)
            _plan_call(call_key, group, scale, dropout_p, is_causal, return_lse, mask, score, params, sinks, spec,
                       backend, query, key, value, score_arg, sinks_arg)
    if unbatched:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out


def attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
              enable_gqa: bool = False, *, score: str = "softmax", score_params=None,
              adaptive_temperature: bool = False, poly: Sequence[float] = DEFAULT_POLY,
              threshold: float = DEFAULT_THRESHOLD, backend: str = "auto", return_lse: bool = False,
              deterministic: bool = False, window_size: Tuple[int, int] = (-1, -1),
              sinks: Optional[Scalar] = None, softcap: float = 0.0):
    """Attention with any registered score function, a drop-in for ``F.scaled_dot_product_attention``.

    Weights ``softmax(phi(z) + mask)`` of the logits ``z = scale * q.k`` (soft-capped first when
    ``softcap > 0``), ``phi`` the score function ``score`` (``ssa_flash.scores.SCORES``):

    * ``"softmax"``: ``phi(z) = z``, no parameters (= :func:`softmax_attention`);
    * ``"ssa"``: ``phi(z) = n sgn(z) log1p(b|z|)``, parameters ``b > 0``, ``n >= 0``
      (= :func:`ssa_attention`);
    * ``"logit_scale"``: ``phi(z) = s z``, a learnable per-head logit scale ``s >= 0`` (``s = 0``:
      uniform weights over the admissible keys).

    Args:
        score_params: the score function's per-head parameters, a dict by name
            (``{"b": 0.7, "n": 2.0}``) or a sequence in the registry's order; each a number or a
            tensor of shape () or (Hq,) (gradients flow to tensors), checked as ``b`` and ``n``
            are in :func:`ssa_attention`. None for ``"softmax"``.
        Everything else: as in :func:`ssa_attention` (``adaptive_temperature`` tempers
        ``phi(z) + mask``).

    Returns:
        ``out (B, Hq, Lq, Dv)``, or ``(out, lse)`` with ``return_lse``.
    """
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      score=score, score_params=score_params, adaptive=adaptive_temperature, poly=poly,
                      threshold=threshold, backend=backend, return_lse=return_lse,
                      deterministic=deterministic, window_size=window_size, sinks=sinks, softcap=softcap)


def ssa_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                  enable_gqa: bool = False, *, b: Scalar = 1.0, n: Scalar = 1.5,
                  adaptive_temperature: bool = False, poly: Sequence[float] = DEFAULT_POLY,
                  threshold: float = DEFAULT_THRESHOLD, backend: str = "auto",
                  return_lse: bool = False, deterministic: bool = False,
                  window_size: Tuple[int, int] = (-1, -1), sinks: Optional[Scalar] = None,
                  softcap: float = 0.0):
    """Scaled Signed Averaging attention, a drop-in for ``F.scaled_dot_product_attention``.

    Weights ``(1 + b|z|)^(sgn(z) n)`` of the logits ``z = scale * q.k``, normalised over the keys:
    ``softmax(phi(z) + mask)`` with ``phi(z) = n sgn(z) log1p(b|z|)``.

    Args:
        query: ``(B, Hq, Lq, D)`` (or ``(Hq, Lq, D)``); key: ``(B, Hkv, Lk, D)``; value: ``(B, Hkv, Lk, Dv)``.
            Also SDPA's other shapes (any leading batch dims, 2-D, batch and head dims broadcast:
            ``ssa_flash._shapes``) and jagged nested ``(B, H, j, D)`` tensors (``ssa_flash._nested``).
        attn_mask: bool (True = attend) or float (added to ``phi(z)``), broadcastable to (B, Hq, Lq, Lk).
        dropout_p: in [0, 1]: SDPA's dropout on the final weights (after any temperature): each
            kept with probability ``1 - dropout_p`` and scaled by ``1 / (1 - dropout_p)``; the LSE
            is the undropped row's; 1 gives zeros. Applied whenever > 0 (pass 0 in eval mode, as
            with SDPA). The bits come from a Philox generator in the kernels keyed by a (seed,
            offset) drawn from torch's default generator for the device, so ``torch.manual_seed``
            reproduces a call; :func:`dropout_mask` materialises the mask. Every backend draws the
            same bits for the same (seed, offset): Triton, CUDA C++ and the reference.
        is_causal: key j is visible to query i iff j <= i (SDPA's top-left alignment); combines
            with ``attn_mask`` when both are given.
        scale: defaults to ``1 / sqrt(D)``.
        enable_gqa: query head h uses key/value head ``h // (Hq // Hkv)``.
        b, n: numbers or tensors of shape () or (Hq,), ``b > 0`` and ``n >= 0`` (``n = 0``:
            uniform weights); gradients flow to tensors. A tensor's values are checked when it is
            on the CPU, never on a GPU (no device synchronisation; see ``_check_head_param``).
        adaptive_temperature: apply the entropy-driven temperature of "Softmax is not Enough" to
            the SSA log-weights, with polynomial ``poly`` (highest degree first) and ``threshold``.
        backend: "auto", "triton", "cuda" or "reference".
        return_lse: also return the natural-log log-sum-exp of each normalised row, (B, Hq, Lq),
            float32 (float64 for float64 inputs), ``-inf`` for rows with no admissible key.
        deterministic: bitwise reproducible forward and backward across calls, processes and ranks
            on the same GPU model and software versions (fixed block configurations, no
            floating-point atomics); the default may use timed choices and atomics
            (docs/reliability.md). ``torch.use_deterministic_algorithms(True)`` turns it on.
        window_size: ``(left, right)`` local attention: query i attends key j only if
            ``i - left <= j <= i + right`` (top-left aligned like ``is_causal``; -1: that side
            unbounded; ``(-1, -1)``, the default: no window). Intersects with ``is_causal`` and
            ``attn_mask`` (Mistral's sliding window W: ``is_causal=True, window_size=(W - 1, -1)``).
            Key blocks outside the window are skipped (Triton and CUDA C++ backends; the
            reference masks them).
        sinks: attention sinks (docs/design.md §1.6): None (the default: none), a number or a
            floating tensor of shape () or (Hq,) on the query's device (may require grad): head
            ``h``'s rows get one more logit ``s_h`` whose value vector is zero, so a row's
            weights sum to less than 1 and a row with no admissible key puts all its weight on
            the sink (output 0, lse ``s_h``). The sink counts in the LSE and, under the adaptive
            temperature, in the entropy, and ``beta`` scales it; dropout never drops it.
            ``-inf``: no sink for that head.
        softcap: logit soft-capping ``c >= 0`` (0, the default: off): the scaled score ``z``
            becomes ``c tanh(z / c)`` before the SSA transform; masks are added after.
            Which backends implement ``sinks`` and ``softcap``: docs/support.md (``"auto"``
            takes the first that does).

    Returns:
        ``out (B, Hq, Lq, Dv)`` in the input dtype, or ``(out, lse)``. Rows with no admissible key
        give 0 and zero gradients. Under ``torch.autocast`` (SDPA's rule): query, key and value
        in the autocast dtype (float64 excepted), so the output is in it too; masks, ``b``, ``n``
        and ``sinks`` stay as given; gradients reach the inputs in their own dtypes.
    """
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      score=scores.SSA, score_params=(b, n), adaptive=adaptive_temperature, poly=poly,
                      threshold=threshold,
                      backend=backend, return_lse=return_lse, deterministic=deterministic,
                      window_size=window_size, sinks=sinks, softcap=softcap)


def softmax_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                      enable_gqa: bool = False, *, backend: str = "auto", return_lse: bool = False,
                      deterministic: bool = False, window_size: Tuple[int, int] = (-1, -1),
                      sinks: Optional[Scalar] = None, softcap: float = 0.0):
    """Softmax attention through the same kernels: what SDPA computes (the baseline and a check),
    except that a row with no admissible key gives 0 instead of NaN. Arguments as ``ssa_attention``
    (``softcap`` caps the logits ``z`` themselves)."""
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      score=scores.SOFTMAX, score_params=(), adaptive=False, poly=DEFAULT_POLY,
                      threshold=DEFAULT_THRESHOLD,
                      backend=backend, return_lse=return_lse, deterministic=deterministic,
                      window_size=window_size, sinks=sinks, softcap=softcap)


def adaptive_temperature_attention(query: Tensor, key: Tensor, value: Tensor,
                                   attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                   is_causal: bool = False, scale: Optional[float] = None,
                                   enable_gqa: bool = False, *, poly: Sequence[float] = DEFAULT_POLY,
                                   threshold: float = DEFAULT_THRESHOLD, backend: str = "auto",
                                   return_lse: bool = False, deterministic: bool = False,
                                   window_size: Tuple[int, int] = (-1, -1),
                                   sinks: Optional[Scalar] = None, softcap: float = 0.0):
    """Softmax attention with the adaptive temperature of "Softmax is not Enough": each row's
    logits ``l = z + mask`` are multiplied by ``beta = max(poly(H), 1)`` when the row's entropy
    ``H`` exceeds ``threshold`` (else 1). Two streamed passes, O(L) memory; the backward is the
    exact derivative, through beta. Arguments as ``ssa_attention``; ``lse`` is that of ``beta * l``.
    The entropy (hence beta) is that of the undropped row restricted to the window; dropout acts
    on the final weights ``softmax(beta * l)``. With ``sinks`` the row is ``[l, s_h]``: the sink
    counts in the entropy and ``beta`` scales it too."""
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      score=scores.SOFTMAX, score_params=(), adaptive=True, poly=poly, threshold=threshold,
                      backend=backend, return_lse=return_lse, deterministic=deterministic,
                      window_size=window_size, sinks=sinks, softcap=softcap)


def attention_entropy(query: Tensor, key: Tensor, attn_mask: Optional[Tensor] = None,
                      is_causal: bool = False, scale: Optional[float] = None,
                      enable_gqa: bool = False, *, score: str = "softmax", score_params=None,
                      backend: str = "auto", window_size: Tuple[int, int] = (-1, -1),
                      sinks: Optional[Scalar] = None, softcap: float = 0.0) -> Tensor:
    """Per-row entropy (natural log) of the attention weights, ``(B, Hq, Lq)``, in O(L) memory:
    of ``softmax(phi(z) + mask)`` for the score function ``score`` with ``score_params`` (as in
    :func:`attention`: softmax by default, ``score="ssa", score_params={"b": b, "n": n}`` for SSA),
    over the keys that ``is_causal``, ``window_size`` (as in :func:`ssa_attention`) and the mask
    admit. Rows with no admissible key have entropy 0. With ``sinks``, the entropy of the whole
    row ``softmax([l, s_h])``, sink entry included (what drives the adaptive temperature);
    ``softcap`` as in :func:`ssa_attention`. Not differentiable (a diagnostic). Under
    ``torch.autocast``, ``query`` and ``key`` in the autocast dtype, as the attention functions."""
    cast = _autocast_dtype(query)
    if cast is not None:
        query, key = _autocast(cast, query, key)
        with torch.autocast(query.device.type, enabled=False):
            return attention_entropy(query, key, attn_mask, is_causal, scale, enable_gqa, score=score,
                                     score_params=score_params, backend=backend, window_size=window_size,
                                     sinks=sinks, softcap=softcap)
    enable_gqa = _check_bool("enable_gqa", enable_gqa)
    if isinstance(query, Tensor) and isinstance(key, Tensor) and (
            query.is_nested or key.is_nested or query.dim() != 4 or key.dim() != 4
            or key.shape[0] != query.shape[0] or (key.shape[1] != query.shape[1] and not enable_gqa)):
        if query.is_nested or key.is_nested:
            raise ValueError("attention_entropy does not take nested tensors")
        return _shapes.entropy(attention_entropy, query, key, attn_mask, enable_gqa, is_causal=is_causal, scale=scale,
                               score=score, score_params=score_params, backend=backend, window_size=window_size,
                               sinks=sinks, softcap=softcap)
    _check_tensor("query", query)
    _check_tensor("key", key)
    unbatched = query.dim() == 3
    if unbatched:
        if key.dim() != 3:
            raise ValueError(f"key must have 3 dims like query, got shape {tuple(key.shape)}")
        query, key = query.unsqueeze(0), key.unsqueeze(0)
        if isinstance(attn_mask, Tensor) and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
    group = _check_qkv(query, key, key, enable_gqa)
    is_causal = _check_bool("is_causal", is_causal)
    scale = _check_common(0.0, is_causal, scale, query.shape[-1], False)
    left, right = _effective_window(_check_window(window_size), query.shape[2], key.shape[2], is_causal)
    mask = _check_mask(attn_mask, query, key)
    score, params = _check_score(score, score_params, query.shape[1], query)
    sinks = _check_sinks(sinks, query.shape[1], query)
    softcap = _check_softcap(softcap)
    spec = AttentionSpec(scale=scale, score=score.name, causal=is_causal, group=group, window_left=left,
                         window_right=right, softcap=softcap)
    backend = _resolve_backend(backend, query, key, key, spec, sinks)
    if _degenerate(query, key, key):
        backend = "reference"
    with torch.no_grad():
        ent = autograd.row_entropy(query, key, params, mask, backend, spec, **_sink_arg(sinks))
    return ent.squeeze(0) if unbatched else ent


# --------------------------------------------------------------------------------------------
# Packed variable-length batches and KV-cache decoding (docs/design.md §1.5)


def _check_int(name: str, x, *, minimum: int) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return int(x)


def _check_index_tensor(name: str, x, length: Optional[int], device) -> Tensor:
    """An int32, 1-D, contiguous tensor on ``device`` (of ``length`` entries if given)."""
    _check_tensor(name, x)
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor, got {x.dtype}")
    if x.dim() != 1 or (length is not None and x.shape[0] != length):
        want = f"({length},)" if length is not None else "1-D"
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if x.device != torch.device(device):
        raise ValueError(f"{name} is on {x.device} but query is on {device}")
    return x


def _host_checkable(*tensors) -> bool:
    """Values may be read for validation only where that costs no device sync and no graph break."""
    return all(t.device.type == "cpu" for t in tensors) and not torch.compiler.is_compiling()


def _check_cu_seqlens(name: str, cu: Tensor, total: int, max_seqlen: int, max_name: str) -> None:
    if cu.shape[0] < 1:
        raise ValueError(f"{name} must have batch + 1 >= 1 entries")
    if not _host_checkable(cu):
        return
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the number of rows ({total}), got "
                         f"{values[0]} ... {values[-1]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(length < 0 for length in lengths):
        raise ValueError(f"{name} must be non-decreasing")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{max_name} ({max_seqlen}) is less than the longest sequence in {name} ({max(lengths)})")


def _check_packed_qkv(query, key, value, enable_gqa: bool) -> int:
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, x)
        if x.dim() != 3:
            raise ValueError(f"{name} must have 3 dims (total_tokens, heads, head_dim), got shape {tuple(x.shape)}")
    if value.shape[:2] != key.shape[:2]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same rows and heads")
    # the dense checks on (1, H, total, D) views: dtypes, devices, head dims, heads, GQA
    return _check_qkv(*(x.transpose(0, 1).unsqueeze(0) for x in (query, key, value)), enable_gqa)


def varlen_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                     enable_gqa: bool = False, *, score: Optional[str] = None, score_params=None,
                     adaptive_temperature: bool = False, poly: Sequence[float] = DEFAULT_POLY,
                     threshold: float = DEFAULT_THRESHOLD, window_size: Tuple[int, int] = (-1, -1),
                     return_lse: bool = False, backend: str = "auto", deterministic: bool = False,
                     sinks: Optional[Scalar] = None, softcap: float = 0.0):
    """Attention over a packed batch of variable-length sequences (FlashAttention's ``varlen``
    layout): no padding, no mask.

    Sequence ``s`` is query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` attending to key/value rows
    ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``, with every rule of :func:`ssa_attention` applied inside
    the sequence (``is_causal``: key ``j`` visible to query ``i`` iff ``j <= i``, positions counted
    from the sequence's start, SDPA's top-left alignment). Sequences may be empty; a query row with
    no key gets 0 and zero gradients.

    Args:
        query: ``(total_q, Hq, D)``; key: ``(total_k, Hkv, D)``; value: ``(total_k, Hkv, Dv)``; any strides.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` contiguous cumulative offsets, on the
            tensors' device, starting at 0 and ending at ``total_q`` / ``total_k``.
        max_seqlen_q, max_seqlen_k: ints > 0, at least the longest sequence (they size the kernel
            grid); a value above ``total_q`` / ``total_k`` is lowered to it (no sequence is
            longer), which changes no result. Values of ``cu_seqlens_*`` are checked on the CPU
            only (reading them on a GPU would synchronise): on a GPU, inconsistent offsets or a
            too small ``max_seqlen`` leave rows uncomputed.
        dropout_p: as in :func:`ssa_attention`; sequence ``s`` draws the bits of batch element
            ``s``: ``ssa_flash.dropout_mask((batch, Hq, max_seqlen_q, max_seqlen_k), p)`` (same
            seed) sliced to ``[s, :, :Lq_s, :Lk_s]`` is its keep mask.
        window_size: ``(left, right)`` as in :func:`ssa_attention`, positions counted from each
            sequence's start (top-left, like ``is_causal``).
        score, score_params: the score function and its per-head parameters, as in
            :func:`attention`; None (the default): softmax (SSA: ``score="ssa",
            score_params={"b": b, "n": n}``).
        is_causal, scale, enable_gqa, adaptive_temperature, poly, threshold, deterministic,
            sinks, softcap: as in :func:`attention`; a sink is per row (a sequence with no key
            puts its rows on the sink).
        backend: "auto", "triton" or "reference" ("cuda": the CUDA C++ backend does not implement
            packed batches; ``auto`` never picks it for them).

    Returns:
        ``out (total_q, Hq, Dv)`` in the input dtype, or ``(out, lse)`` with ``lse (Hq, total_q)``
        (float32, float64 for float64 inputs; ``-inf`` on rows with no key and no sink).
        Differentiable in query, key, value, the score's parameters and sinks (and through ``lse``). Under
        ``torch.autocast``, query, key and value in the autocast dtype, as in :func:`ssa_attention`.
    """
    cast = _autocast_dtype(query)
    if cast is not None:
        query, key, value = _autocast(cast, query, key, value)
        with torch.autocast(query.device.type, enabled=False):
            return varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p, is_causal, scale, enable_gqa, score=score,
                                    score_params=score_params, adaptive_temperature=adaptive_temperature, poly=poly,
                                    threshold=threshold,
                                    window_size=window_size, return_lse=return_lse, backend=backend,
                                    deterministic=deterministic, sinks=sinks, softcap=softcap)
    enable_gqa = _check_bool("enable_gqa", enable_gqa)
    adaptive_temperature = _check_bool("adaptive_temperature", adaptive_temperature)
    deterministic = _check_bool("deterministic", deterministic) or torch.are_deterministic_algorithms_enabled()
    group = _check_packed_qkv(query, key, value, enable_gqa)
    cu_q = _check_index_tensor("cu_seqlens_q", cu_seqlens_q, None, query.device)
    cu_k = _check_index_tensor("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape[0], query.device)
    max_seqlen_q = _check_int("max_seqlen_q", max_seqlen_q, minimum=1)
    max_seqlen_k = _check_int("max_seqlen_k", max_seqlen_k, minimum=1)
    _check_cu_seqlens("cu_seqlens_q", cu_q, query.shape[0], max_seqlen_q, "max_seqlen_q")
    _check_cu_seqlens("cu_seqlens_k", cu_k, key.shape[0], max_seqlen_k, "max_seqlen_k")
    # No sequence is longer than all the rows: a larger bound only sizes the grid and the window
    # bounds (and past 2^31 overflows the kernels' int32 arguments), so it is lowered to the rows.
    # Results are unchanged: the dropout bits are functions of the indices, not of these bounds.
    max_seqlen_q = min(max_seqlen_q, max(query.shape[0], 1))
    max_seqlen_k = min(max_seqlen_k, max(key.shape[0], 1))
    is_causal, return_lse = _check_bool("is_causal", is_causal), _check_bool("return_lse", return_lse)
    scale = _check_common(dropout_p, is_causal, scale, query.shape[-1], return_lse)
    dropout_p = float(dropout_p)
    # a side that excludes nothing in the longest sequences excludes nothing in any
    left, right = _effective_window(_check_window(window_size), max_seqlen_q, max_seqlen_k, is_causal)
    score, params, poly, threshold, sinks, softcap = _check_variant(
        query, "softmax" if score is None else score, score_params, adaptive_temperature, poly, threshold, sinks,
        softcap)
    rng = draw_dropout_rng(query.device) if dropout_p > 0 else None
    spec = AttentionSpec(scale=scale, score=score.name, causal=is_causal, group=group, adaptive=adaptive_temperature,
                         poly=poly, threshold=threshold, deterministic=deterministic,
                         cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, window_left=left,
                         window_right=right, dropout_rng=rng, softcap=softcap)
    backend = _resolve_backend(backend, query, key, value, spec, sinks)
    if _degenerate(query, key, value, key_dim=0):
        backend = "reference"
    out, lse = autograd.attention(query, key, value, params, None, backend, spec, **_sink_arg(sinks))
    return (out, lse) if return_lse else out


# The narrowest key tile of any Triton kernel configuration (ssa_flash.triton.launch's block
# tables): the most splits a KV cache's keys can be shared among usefully is ceil(Lcache / 16).
_MIN_KEY_TILE = 16


def _check_cache(query, k_cache, v_cache, key, value, enable_gqa: bool) -> int:
    group = _check_qkv(query, k_cache, v_cache, enable_gqa, names=("query", "k_cache", "v_cache"),
                       dims="4 dims (B, H, L, D)")
    if (key is None) != (value is None):
        raise ValueError("give both key and value (new rows for the cache) or neither")
    if key is not None:
        for name, x, cache in (("key", key, k_cache), ("value", value, v_cache)):
            _check_tensor(name, x)
            if x.dtype != cache.dtype:
                raise TypeError(f"{name} must have the cache's dtype {cache.dtype}, got {x.dtype}")
            if x.device != cache.device:
                raise ValueError(f"{name} is on {x.device} but the cache is on {cache.device}")
            if (x.dim() != 4 or x.shape[:2] != cache.shape[:2] or x.shape[3] != cache.shape[3]
                    or x.shape[2] > cache.shape[2]):
                raise ValueError(f"{name} must have shape (B, Hkv, Lnew, d) = ({cache.shape[0]}, {cache.shape[1]}, "
                                 f"Lnew <= {cache.shape[2]}, {cache.shape[3]}), got {tuple(x.shape)}")
        if key.shape[2] != value.shape[2]:
            raise ValueError(f"key and value must have the same number of new rows, got {key.shape[2]} and {value.shape[2]}")
    return group


def _append_to_cache(cache: Tensor, new: Tensor, cache_seqlens: Tensor) -> None:
    """Writes ``new (B, H, Lnew, d)`` into ``cache`` at rows ``cache_seqlens[b] + [0, Lnew)``, in
    place, without reading ``cache_seqlens`` on the host. Rows are clamped into the cache: GPU
    values are not validated (no device synchronisation), and an out-of-range scatter index is a
    device-side assert that ends the CUDA context, where a clamped one only writes a wrong row
    (meaningless results for out-of-range input, as documented)."""
    B, H, Lnew, d = new.shape
    rows = cache_seqlens.to(torch.int64)[:, None] + torch.arange(Lnew, device=cache.device)
    rows = rows.clamp(0, cache.shape[2] - 1)
    cache.scatter_(2, rows[:, None, :, None].expand(B, H, Lnew, d), new)


def attention_with_kvcache(query: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                           key: Optional[Tensor] = None, value: Optional[Tensor] = None, *,
                           is_causal: bool = False, scale: Optional[float] = None,
                           enable_gqa: bool = False, score: Optional[str] = None, score_params=None,
                           adaptive_temperature: bool = False,
                           poly: Sequence[float] = DEFAULT_POLY, threshold: float = DEFAULT_THRESHOLD,
                           window_size: Tuple[int, int] = (-1, -1), return_lse: bool = False,
                           cache_leftpad: Optional[Tensor] = None, num_splits: int = 0,
                           backend: str = "auto", sinks: Optional[Scalar] = None,
                           softcap: float = 0.0):
    """Attention of a few queries over a KV cache (decoding), with the keys split across programs.

    Batch element ``b`` of ``k_cache``/``v_cache`` holds ``cache_seqlens[b]`` valid rows. If ``key``
    and ``value`` are given, they are first written into the caches in place at rows
    ``cache_seqlens[b] : cache_seqlens[b] + Lnew`` and attended too (the caches then hold
    ``cache_len = cache_seqlens[b] + Lnew`` valid rows; ``cache_seqlens`` itself is not changed).
    ``is_causal`` is bottom-right aligned, as in every KV-cache API: query ``i`` of ``Lq`` is at
    position ``cache_len - Lq + i`` and sees the rows up to it.

    Forward only: the output carries no gradient (use :func:`ssa_attention` or
    :func:`varlen_attention` to train).

    Split-KV: when ``B * Hq * ceil(Lq / 16)`` programs would leave a GPU's SMs idle (decoding at small
    batch), each row's keys are shared among several programs whose partial results are merged by
    their log-sum-exps (also the adaptive temperature's entropy statistics); the heuristic fills one
    wave of the GPU's SMs with splits of at least 4 key tiles each (``ssa_flash.triton.launch.
    num_splits_heuristic``). ``num_splits`` forces a split count (1: no split; 0: the heuristic);
    it is lowered to ``ceil(Lcache / 16)``, the most key tiles a cache has (16 rows: the narrowest
    tile), since a split beyond that would have no key to read.

    Args:
        query: ``(B, Hq, Lq, D)``; k_cache: ``(B, Hkv, Lcache, D)``; v_cache: ``(B, Hkv, Lcache, Dv)``.
        cache_seqlens: int32 ``(B,)`` on the query's device. Values are checked on the CPU only
            (``0 <= cache_seqlens[b]`` and ``cache_seqlens[b] + Lnew <= Lcache``); on a GPU the kernels
            clamp to the cache (never read outside it), but rows written past the cache's end fail.
        key, value: ``(B, Hkv, Lnew, D)`` / ``(B, Hkv, Lnew, Dv)``, or None.
        cache_leftpad: int32 ``(B,)`` or None: rows before ``cache_leftpad[b]`` are not attended
            (left padding of a batch of prompts); positions still count from row 0.
        window_size: ``(left, right)``, bottom-right aligned like ``is_causal``: query ``i`` sees
            cache rows ``j`` with ``pos_i - left <= j <= pos_i + right``, ``pos_i = cache_len - Lq +
            i`` (-1: that side unbounded); key blocks outside it are skipped (Mistral-style decoding
            with a sliding window: ``is_causal=True, window_size=(W - 1, -1)``).
        is_causal, scale, enable_gqa, score, score_params, adaptive_temperature, poly, threshold,
            sinks, softcap: as in :func:`varlen_attention` (a batch element with no row to attend puts
            its rows on the sink: output 0, ``lse = s_h``).
        backend: "auto", "triton" or "reference" (the CUDA C++ backend does not implement it).

    Returns:
        ``out (B, Hq, Lq, Dv)`` in the input dtype, or ``(out, lse)`` with ``lse (B, Hq, Lq)``. A batch
        element with no row to attend (or a query row seeing none) gets 0 and ``lse = -inf``.
    """
    enable_gqa = _check_bool("enable_gqa", enable_gqa)
    adaptive_temperature = _check_bool("adaptive_temperature", adaptive_temperature)
    group = _check_cache(query, k_cache, v_cache, key, value, enable_gqa)
    B, Lcache = query.shape[0], k_cache.shape[2]
    seqlens = _check_index_tensor("cache_seqlens", cache_seqlens, B, query.device)
    if cache_leftpad is not None:
        _check_index_tensor("cache_leftpad", cache_leftpad, B, query.device)
    num_splits = _check_int("num_splits", num_splits, minimum=0)
    # More splits than key tiles leave programs with no key: each still launches and writes a
    # partial result to merge (1000 splits of a 16-row cache ran minutes where 1 takes 0.2 s).
    # The kernels' key tiles are never narrower than _MIN_KEY_TILE rows.
    num_splits = min(num_splits, max(1, -(-Lcache // _MIN_KEY_TILE)))
    lnew = 0 if key is None else key.shape[2]
    if _host_checkable(seqlens):
        lengths = seqlens.tolist()
        if any(x < 0 or x + lnew > Lcache for x in lengths):
            raise ValueError(f"cache_seqlens must be in [0, Lcache - Lnew] = [0, {Lcache - lnew}], got {lengths}")
        if cache_leftpad is not None and any(p < 0 or p > x + lnew for p, x in zip(cache_leftpad.tolist(), lengths)):
            raise ValueError("cache_leftpad must be in [0, cache_seqlens + Lnew] for every batch element")
    left, right = _check_window(window_size)
    is_causal, return_lse = _check_bool("is_causal", is_causal), _check_bool("return_lse", return_lse)
    scale = _check_common(0.0, is_causal, scale, query.shape[-1], return_lse)
    score, params, poly, threshold, sinks, softcap = _check_variant(
        query, "softmax" if score is None else score, score_params, adaptive_temperature, poly, threshold, sinks,
        softcap)
    used = seqlens if lnew == 0 else seqlens + lnew
    spec = AttentionSpec(scale=scale, score=score.name, causal=is_causal, group=group, adaptive=adaptive_temperature,
                         poly=poly, threshold=threshold, seqused_k=used, k_start=cache_leftpad,
                         num_splits=num_splits, window_left=left, window_right=right, softcap=softcap)
    backend = _resolve_backend(backend, query, k_cache, v_cache, spec, sinks)
    if _degenerate(query, k_cache, v_cache):
        backend = "reference"
    with torch.no_grad():
        if key is not None:
            _append_to_cache(k_cache, key, seqlens)
            _append_to_cache(v_cache, value, seqlens)
        out, lse = autograd.attention(query, k_cache, v_cache, params, None, backend, spec, **_sink_arg(sinks))
    return (out, lse) if return_lse else out


def dropout_mask(shape: Sequence[int], dropout_p: float, *, device: Union[str, torch.device] = "cpu",
                 rng: Optional[Tensor] = None, backend: str = "auto") -> Tensor:
    """The dropout keep-mask that an attention call applies, as a bool tensor ``(B, Hq, Lq, Lk)``
    (True = kept), for tests and inspection (O(B Hq Lq Lk) memory).

    ``shape`` is ``(B, Hq, Lq, Lk)`` of the call (an unbatched call has ``B = 1``). ``rng`` is the
    ``(seed, offset)`` int64 tensor ``(2,)``; None draws it from torch's default generator for
    ``device`` exactly as an attention call does, so that::

        torch.manual_seed(s); out = ssa_flash.ssa_attention(q, k, v, dropout_p=p)
        torch.manual_seed(s); keep = ssa_flash.dropout_mask((B, Hq, Lq, Lk), p, device=q.device)

    gives the mask ``out`` was computed with (``ssa_flash.reference.attention(q, k, v, score="ssa",
    score_params=(1.0, 1.5), dropout_p=p, dropout_mask=keep)`` then equals ``out``). ``backend``:
    ``"triton"`` runs a small
    kernel that calls the attention kernels' own mask function (on tiles of other sizes),
    ``"reference"`` the PyTorch Philox of ``ssa_flash.reference.dropout_keep_mask``, ``"auto"``
    the first that runs on ``device``. Element ``(b, h, i, j)`` is kept iff word
    ``bit3(i) + 2 bit0(j)`` of Philox4x32-10 (key: the seed; counter: ``(j // 2,
    (i // 16) 8 + i % 8, h, (b + offset) mod 2^32)``) is below ``2 round((1 - p) 2^31)``: a
    function of the indices alone, never of the kernels' tiles.

    On the ``meta`` device (shape inference, models built without memory) the result is an
    uninitialised meta tensor of the right shape and dtype, like any torch function's there; the
    default generator is not drawn from.
    """
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or len(shape) != 4:
        raise ValueError(f"shape must be (B, Hq, Lq, Lk), got {shape!r}")
    for x in shape:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0:
            raise ValueError(f"shape must hold 4 ints >= 0, got {tuple(shape)}")
    p = _check_number("dropout_p", dropout_p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {p}")
    if not isinstance(backend, str) or backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if rng is None:
        if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
            raise TypeError(f"device must be a str, torch.device or CUDA index, got {_type_name(device)}")
        try:
            device = torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"device: {err}") from None
    else:
        _check_tensor("rng", rng)
        if rng.dtype != torch.int64 or tuple(rng.shape) != (2,):
            raise ValueError(f"rng must be an int64 tensor of shape (2,) (seed, offset), got "
                             f"{rng.dtype} of shape {tuple(rng.shape)}")
        device = rng.device
    shape = tuple(int(x) for x in shape)
    if device.type == "meta":  # no data to draw or compute: the shape only
        return torch.empty(shape, dtype=torch.bool, device=device)
    if rng is None:
        rng = draw_dropout_rng(device)
    if backend == "auto":
        backend = "triton" if backends.get("triton").unavailable_reason(device) is None else "reference"
    why = backends.get(backend).unavailable_reason(device)
    if why:
        raise BackendUnavailableError(f"backend={backend!r} is unavailable: {why}")
    return backends.get(backend).dropout_mask(rng, shape, p)
