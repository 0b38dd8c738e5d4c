"""Autograd glue between the public functions and the Triton kernels, as ``torch.library`` custom ops.

Two operators, each opaque to ``torch.compile`` (Dynamo records a call, it never traces into
Triton) and each with a fake (meta) implementation that only computes output shapes:

* ``ssa_flash::attn_fwd(q, k, v, b?, n?, mask?, scale, causal, group, adaptive, poly, threshold)``
  returns ``(out, lse, beta, lse_l, entropy, dbeta_dh)``. The last four are the per-row
  ``(B, Hq, Lq)`` statistics of the adaptive temperature (``launch.TemperatureState``); without
  adaptive temperature they are empty ``(0,)`` placeholders (a custom-op schema cannot return
  ``None``). They are not differentiable and not returned to users.
* ``ssa_flash::attn_bwd(dout?, dlse?, q, k, v, out, lse, b?, n?, mask?, beta?, lse_l?, entropy?,
  dbeta_dh?, scale, causal, group, adaptive)`` returns ``(dq, dk, dv, db, dn)``; ``db``/``dn`` are
  ``(Hq,)`` for SSA and empty ``(0,)`` for softmax.

``attn_fwd``'s autograd formula (``torch.library.register_autograd``) saves q, k, v, out, lse, b, n,
the mask and the temperature statistics, and calls ``attn_bwd``. The backward accepts a gradient
for ``lse`` (``return_lse=True`` users may differentiate through it).

The mask arrives as an expanded (stride-0) view of the user's mask: custom ops take any strides,
so it is passed as is and never materialised. ``b`` and ``n`` are ``(Hq,)`` tensors in the
accumulation dtype; for softmax they are ``None`` (``Optional[Tensor]`` in the schema).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import temperature

__all__ = ["flash_attention"]


def _triton():
    from .triton import launch  # imported lazily: Triton is optional for the reference backend

    return launch


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _spec(launch, scale: float, causal: bool, group: int, ssa: bool, adaptive: bool):
    return launch.AttentionSpec(scale=float(scale), causal=bool(causal), group=int(group), ssa=ssa,
                                adaptive=bool(adaptive))


# --------------------------------------------------------------------------------------------
# Forward


@torch.library.custom_op("ssa_flash::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, b: Optional[Tensor], n: Optional[Tensor],
             mask: Optional[Tensor], scale: float, causal: bool, group: int, adaptive: bool,
             poly: List[float], threshold: float
             ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    launch = _triton()
    spec = _spec(launch, scale, causal, group, b is not None, adaptive)
    if adaptive:
        ent, lse_l = launch.row_entropy(q, k, mask, b, n, spec)
        beta, dbeta_dh = temperature.beta_from_entropy(ent, poly, threshold)
        out, lse = launch.forward(q, k, v, mask, b, n, beta, spec)
        return out, lse, beta, lse_l, ent, dbeta_dh
    out, lse = launch.forward(q, k, v, mask, b, n, None, spec)
    empty = [q.new_empty((0,), dtype=lse.dtype) for _ in range(4)]
    return (out, lse, *empty)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, b, n, mask, scale, causal, group, adaptive, poly, threshold):
    B, H, Lq, _ = q.shape
    acc = _acc_dtype(q)
    out = q.new_empty((B, H, Lq, v.shape[-1]))
    lse = q.new_empty((B, H, Lq), dtype=acc)
    stat_shape = (B, H, Lq) if adaptive else (0,)
    stats = [q.new_empty(stat_shape, dtype=acc) for _ in range(4)]
    return (out, lse, *stats)


# --------------------------------------------------------------------------------------------
# Backward


@torch.library.custom_op("ssa_flash::attn_bwd", mutates_args=())
def attn_bwd(dout: Optional[Tensor], dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
             out: Tensor, lse: Tensor, b: Optional[Tensor], n: Optional[Tensor],
             mask: Optional[Tensor], beta: Optional[Tensor], lse_l: Optional[Tensor],
             entropy: Optional[Tensor], dbeta_dh: Optional[Tensor], scale: float, causal: bool,
             group: int, adaptive: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    launch = _triton()
    spec = _spec(launch, scale, causal, group, b is not None, adaptive)
    temp = launch.TemperatureState(beta, lse_l, entropy, dbeta_dh) if adaptive else None
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    if dlse is not None:
        dlse = dlse.contiguous()
    dq, dk, dv, db, dn = launch.backward(dout, q, k, v, out, lse, dlse, mask, b, n, temp, spec)
    if db is None:
        db, dn = q.new_empty((0,), dtype=lse.dtype), q.new_empty((0,), dtype=lse.dtype)
    return dq, dk, dv, db, dn


@attn_bwd.register_fake
def _attn_bwd_fake(dout, dlse, q, k, v, out, lse, b, n, mask, beta, lse_l, entropy, dbeta_dh,
                   scale, causal, group, adaptive):
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    heads = q.shape[1] if b is not None else 0
    db = q.new_empty((heads,), dtype=lse.dtype)
    dn = q.new_empty((heads,), dtype=lse.dtype)
    return dq, dk, dv, db, dn


# --------------------------------------------------------------------------------------------
# Autograd formula of attn_fwd


def _setup_context(ctx, inputs, output):
    q, k, v, b, n, mask, scale, causal, group, adaptive, _poly, _threshold = inputs
    out, lse, beta, lse_l, ent, dbeta_dh = output
    ctx.mark_non_differentiable(beta, lse_l, ent, dbeta_dh)
    ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
    ctx.scale, ctx.causal, ctx.group, ctx.adaptive = scale, causal, group, adaptive
    ctx.has_b = b is not None
    ctx.save_for_backward(q, k, v, out, lse, b, n, mask, beta, lse_l, ent, dbeta_dh)


def _backward(ctx, dout, dlse, *_stat_grads):
    q, k, v, out, lse, b, n, mask, beta, lse_l, ent, dbeta_dh = ctx.saved_tensors
    if dout is None and dlse is None:
        return (None,) * 12
    if not ctx.adaptive:
        beta = lse_l = ent = dbeta_dh = None
    dq, dk, dv, db, dn = torch.ops.ssa_flash.attn_bwd(
        dout, dlse, q, k, v, out, lse, b, n, mask, beta, lse_l, ent, dbeta_dh,
        ctx.scale, ctx.causal, ctx.group, ctx.adaptive)
    if not ctx.has_b:
        db = dn = None
    return dq, dk, dv, db, dn, None, None, None, None, None, None, None


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# The entry point used by ssa_flash.ops


def flash_attention(q, k, v, b: Optional[Tensor], n: Optional[Tensor], mask: Optional[Tensor],
                    scale: float, causal: bool, group: int, adaptive: bool,
                    poly: Sequence[float], threshold: float):
    """``(out, lse)`` through the Triton kernels, differentiable in q, k, v, b, n (and through
    ``lse``). Inputs as validated by ``ssa_flash.ops``: q ``(B, Hq, Lq, D)``, k ``(B, Hkv, Lk, D)``,
    v ``(B, Hkv, Lk, Dv)``; b, n ``(Hq,)`` tensors in the accumulation dtype or None (softmax);
    mask None or expanded to ``(B, Hq, Lq, Lk)``."""
    out, lse, *_ = torch.ops.ssa_flash.attn_fwd(
        q, k, v, b, n, mask, float(scale), bool(causal), int(group), bool(adaptive),
        [float(c) for c in poly], float(threshold))
    return out, lse
