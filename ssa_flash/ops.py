"""Public functions: argument validation, the choice of backend, then the custom ops.

Positional arguments are those of ``torch.nn.functional.scaled_dot_product_attention``, so each
function is a drop-in at an SDPA call site. Validation looks only at shapes, dtypes, devices and
Python values: it never reads tensor data from the GPU (no device synchronisation).

The top layer (see ``ssa_flash.backends``): the kernels run through ``ssa_flash.autograd``'s
custom ops, whichever the backend; ``backend="reference"`` (and inputs with no rows, keys or head
dim, where kernels launch nothing) runs ``ssa_flash.reference`` under ordinary autograd.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import autograd, backends, reference
from .backends.spec import AttentionSpec, acc_dtype
from .errors import BackendUnavailableError
from .temperature import DEFAULT_POLY, DEFAULT_THRESHOLD

__all__ = [
    "ssa_attention",
    "softmax_attention",
    "adaptive_temperature_attention",
    "attention_entropy",
    "available_backends",
    "BackendUnavailableError",
]

BACKENDS = ("auto", "triton", "cuda", "reference")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

Scalar = Union[float, Tensor]


# --------------------------------------------------------------------------------------------
# Validation


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _check_bool(name: str, x) -> None:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")


def _check_qkv(query, key, value, enable_gqa: bool) -> int:
    """Validates the three inputs (4-D each); returns the GQA group size ``Hq // Hkv``."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (B, H, L, D) or 3 (H, L, D), got shape {tuple(x.shape)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if key.device != query.device or value.device != query.device:
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}")
    B, Hq, Lq, D = query.shape
    if key.shape[0] != B or value.shape[0] != B:
        raise ValueError(f"batch sizes differ: query {B}, key {key.shape[0]}, value {value.shape[0]}")
    if key.shape[-1] != D:
        raise ValueError(f"key's head dim {key.shape[-1]} must equal query's {D}")
    if value.shape[1] != key.shape[1] or value.shape[2] != key.shape[2]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree in heads and length")
    Hkv = key.shape[1]
    if Hq == Hkv:
        return 1
    if not enable_gqa:
        raise ValueError(f"query has {Hq} heads but key/value have {Hkv}: pass enable_gqa=True for grouped-query attention")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"enable_gqa needs query heads ({Hq}) to be a multiple of key/value heads ({Hkv})")
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
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("attn_mask requires grad: gradients with respect to attn_mask are not supported")
    return attn_mask.expand(full)


def _check_number(name: str, x, *, positive: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    if positive and x <= 0:
        raise ValueError(f"{name} must be > 0, got {x}")
    return x


def _check_common(dropout_p, is_causal, scale, head_dim: int, return_lse) -> float:
    dropout_p = _check_number("dropout_p", dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if dropout_p != 0.0:
        raise NotImplementedError("dropout_p != 0 is not implemented by ssa_flash; pass dropout_p=0.0")
    _check_bool("is_causal", is_causal)
    _check_bool("return_lse", return_lse)
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    return _check_number("scale", scale)


def _check_head_param(name: str, x, heads: int, like: Tensor) -> Tensor:
    """``b`` or ``n``: a positive number or a tensor of shape () or (Hq,). Returns (Hq,) in the
    accumulation dtype, differentiable with respect to the caller's tensor."""
    acc = torch.float64 if like.dtype == torch.float64 else torch.float32
    if isinstance(x, Tensor):
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
        if x.dim() > 1 or (x.dim() == 1 and x.shape[0] != heads):
            raise ValueError(f"{name} must be a number or a tensor of shape () or ({heads},) (one per query head), got {tuple(x.shape)}")
        if x.device != like.device:
            raise ValueError(f"{name} is on {x.device} but query is on {like.device}")
        # Reads the values, so only where that costs no device sync (CPU) and not while
        # torch.compile traces (a data-dependent branch would break the graph).
        if (x.device.type == "cpu" and not x.requires_grad and not torch.compiler.is_compiling()
                and bool((x <= 0).any() | ~torch.isfinite(x).all())):
            raise ValueError(f"{name} must be finite and > 0 for every head")
        return x.to(acc).expand(heads).contiguous()
    value = _check_number(name, x, positive=True)
    return torch.full((heads,), value, dtype=acc, device=like.device)


def _check_poly(poly, threshold) -> Tuple[Tuple[float, ...], float]:
    if isinstance(poly, (str, bytes)) or not isinstance(poly, Sequence) or len(poly) == 0:
        raise TypeError("poly must be a non-empty sequence of coefficients, highest degree first")
    poly = tuple(_check_number(f"poly[{i}]", c) for i, c in enumerate(poly))
    return poly, _check_number("threshold", threshold)


# --------------------------------------------------------------------------------------------
# Backends


def available_backends(device: Union[str, torch.device] = "cuda") -> Tuple[str, ...]:
    """The backends that can run on ``device`` in this process, in ``backend="auto"``'s order of
    preference. The CUDA C++ backend comes after Triton, and ``auto`` does not pick it, on an
    architecture where no GPU run has verified it (``ssa_flash.backends.cuda.VERIFIED_ARCHS``,
    docs/cuda.md); ask for it with ``backend="cuda"``."""
    return backends.available(device)


def _resolve_backend(backend, query: Tensor, key: Tensor, value: Tensor, spec: AttentionSpec) -> str:
    """The backend that runs these inputs, or ``BackendUnavailableError`` saying why none can."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "reference":
        return backend
    name, why = backends.resolve(backend, query.device, query.dtype)
    if why:
        raise BackendUnavailableError(f"backend={backend!r} is unavailable: {why}")
    why = backends.get(name).supports(query, key, value, spec)
    if why and backend == "auto" and name == "cuda":  # a verified CUDA backend, but not for these
        name = "reference" if backends.resolve("triton", query.device, query.dtype)[1] else "triton"
        why = backends.get(name).supports(query, key, value, spec)
    if why:
        raise BackendUnavailableError(f"backend={name!r} cannot run these inputs: {why}")
    return name


# --------------------------------------------------------------------------------------------
# Public functions


def _degenerate(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """No query rows, keys, or head dim: the kernels launch nothing, the reference handles it."""
    return query.numel() == 0 or key.shape[2] == 0 or value.shape[-1] == 0


def _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, b, n,
               adaptive, poly, threshold, backend, return_lse, deterministic):
    _check_bool("enable_gqa", enable_gqa)
    _check_bool("deterministic", deterministic)
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
    scale = _check_common(dropout_p, is_causal, scale, query.shape[-1], return_lse)
    mask = _check_mask(attn_mask, query, key)
    ssa = b is not None
    if ssa:
        b = _check_head_param("b", b, query.shape[1], query)
        n = _check_head_param("n", n, query.shape[1], query)
    if adaptive:
        poly, threshold = _check_poly(poly, threshold)
    if not adaptive:
        poly, threshold = DEFAULT_POLY, DEFAULT_THRESHOLD
    spec = AttentionSpec(scale=scale, causal=is_causal, group=group, adaptive=adaptive, poly=poly,
                         threshold=threshold, deterministic=deterministic)
    backend = _resolve_backend(backend, query, key, value, spec)

    if backend == "reference" or _degenerate(query, key, value):
        out, lse = reference._attend(query, key, value, mask, 0.0, is_causal, scale, group > 1, True,
                                     b=b, n=n, adaptive=adaptive, poly=poly, threshold=threshold)
    else:
        out, lse = autograd.attention(query, key, value, b, n, mask, backend, spec)
    if unbatched:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out


def ssa_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                  enable_gqa: bool = False, *, b: Scalar = 1.0, n: Scalar = 1.5,
                  adaptive_temperature: bool = False, poly: Sequence[float] = DEFAULT_POLY,
                  threshold: float = DEFAULT_THRESHOLD, backend: str = "auto",
                  return_lse: bool = False, deterministic: bool = False):
    """Scaled Signed Averaging attention, a drop-in for ``F.scaled_dot_product_attention``.

    Weights ``(1 + b|z|)^(sgn(z) n)`` of the logits ``z = scale * q.k``, normalised over the keys:
    ``softmax(phi(z) + mask)`` with ``phi(z) = n sgn(z) log1p(b|z|)``.

    Args:
        query: ``(B, Hq, Lq, D)`` (or ``(Hq, Lq, D)``); key: ``(B, Hkv, Lk, D)``; value: ``(B, Hkv, Lk, Dv)``.
        attn_mask: bool (True = attend) or float (added to ``phi(z)``), broadcastable to (B, Hq, Lq, Lk).
        dropout_p: must be 0 (dropout is not implemented).
        is_causal: key j is visible to query i iff j <= i (SDPA's top-left alignment); combines
            with ``attn_mask`` when both are given.
        scale: defaults to ``1 / sqrt(D)``.
        enable_gqa: query head h uses key/value head ``h // (Hq // Hkv)``.
        b, n: positive numbers or tensors of shape () or (Hq,); gradients flow to tensors.
        adaptive_temperature: apply the entropy-driven temperature of "Softmax is not Enough" to
            the SSA log-weights, with polynomial ``poly`` (highest degree first) and ``threshold``.
        backend: "auto", "triton", "cuda" or "reference".
        return_lse: also return the natural-log log-sum-exp of each normalised row, (B, Hq, Lq),
            float32 (float64 for float64 inputs), ``-inf`` for rows with no admissible key.
        deterministic: bitwise reproducible backward. The Triton backend is deterministic always
            (no atomics: per-block partial sums reduced in a fixed order).

    Returns:
        ``out (B, Hq, Lq, Dv)`` in the input dtype, or ``(out, lse)``. Rows with no admissible key
        give 0 and zero gradients.
    """
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      b=b, n=n, adaptive=adaptive_temperature, poly=poly, threshold=threshold,
                      backend=backend, return_lse=return_lse, deterministic=deterministic)


def softmax_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                      enable_gqa: bool = False, *, backend: str = "auto", return_lse: bool = False,
                      deterministic: bool = False):
    """Softmax attention through the same kernels: what SDPA computes (the baseline and a check),
    except that a row with no admissible key gives 0 instead of NaN. Arguments as ``ssa_attention``."""
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      b=None, n=None, adaptive=False, poly=DEFAULT_POLY, threshold=DEFAULT_THRESHOLD,
                      backend=backend, return_lse=return_lse, deterministic=deterministic)


def adaptive_temperature_attention(query: Tensor, key: Tensor, value: Tensor,
                                   attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                   is_causal: bool = False, scale: Optional[float] = None,
                                   enable_gqa: bool = False, *, poly: Sequence[float] = DEFAULT_POLY,
                                   threshold: float = DEFAULT_THRESHOLD, backend: str = "auto",
                                   return_lse: bool = False, deterministic: bool = False):
    """Softmax attention with the adaptive temperature of "Softmax is not Enough": each row's
    logits ``l = z + mask`` are multiplied by ``beta = max(poly(H), 1)`` when the row's entropy
    ``H`` exceeds ``threshold`` (else 1). Two streamed passes, O(L) memory; the backward is the
    exact derivative, through beta. Arguments as ``ssa_attention``; ``lse`` is that of ``beta * l``."""
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      b=None, n=None, adaptive=True, poly=poly, threshold=threshold,
                      backend=backend, return_lse=return_lse, deterministic=deterministic)


def attention_entropy(query: Tensor, key: Tensor, attn_mask: Optional[Tensor] = None,
                      is_causal: bool = False, scale: Optional[float] = None,
                      enable_gqa: bool = False, *, b: Optional[Scalar] = None,
                      n: Optional[Scalar] = None, backend: str = "auto") -> Tensor:
    """Per-row entropy (natural log) of the attention weights, ``(B, Hq, Lq)``, in O(L) memory:
    of ``softmax(z + mask)``, or of SSA's ``softmax(phi(z) + mask)`` when ``b`` and ``n`` are given.
    Rows with no admissible key have entropy 0. Not differentiable (a diagnostic)."""
    _check_bool("enable_gqa", enable_gqa)
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
    scale = _check_common(0.0, is_causal, scale, query.shape[-1], False)
    mask = _check_mask(attn_mask, query, key)
    if (b is None) != (n is None):
        raise ValueError("attention_entropy: give both b and n (SSA) or neither (softmax)")
    if b is not None:
        b = _check_head_param("b", b, query.shape[1], query)
        n = _check_head_param("n", n, query.shape[1], query)
    spec = AttentionSpec(scale=scale, causal=is_causal, group=group)
    backend = _resolve_backend(backend, query, key, key, spec)
    with torch.no_grad():
        if backend == "reference" or _degenerate(query, key, key):
            ent = reference.attention_entropy(query, key, mask, is_causal, scale, group > 1, b=b, n=n)
            ent = ent.to(acc_dtype(query.dtype))
        else:
            ent = autograd.row_entropy(query, key, b, n, mask, backend, spec)
    return ent.squeeze(0) if unbatched else ent
