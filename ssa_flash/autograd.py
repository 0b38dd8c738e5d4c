"""Autograd glue between the public functions and a kernel backend.

A thin ``torch.autograd.Function``: the forward runs the (optional) entropy pass and the flash
pass, saves what the backward recomputes from (q, k, v, o, lse and O(L) per-row statistics), and
the backward returns gradients for q, k, v and the per-head ``b``, ``n``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import temperature


def _triton():
    from .triton import launch  # imported lazily: Triton is optional for the reference backend

    return launch


class FlashAttentionFunction(torch.autograd.Function):
    """Inputs: q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); b, n: (Hq,) tensors in the
    accumulation dtype, or None for softmax; mask: None or expanded to (B, Hq, Lq, Lk).
    Returns ``(out, lse)``."""

    @staticmethod
    def forward(ctx, q, k, v, b, n, mask, scale: float, causal: bool, group: int,
                adaptive: bool, poly: Sequence[float], threshold: float):
        launch = _triton()
        spec = launch.AttentionSpec(scale=scale, causal=causal, group=group, ssa=b is not None,
                                    adaptive=adaptive)
        temp = None
        if adaptive:
            ent, lse_l = launch.row_entropy(q, k, mask, b, n, spec)
            beta, dbeta_dh = temperature.beta_from_entropy(ent, poly, threshold)
            temp = launch.TemperatureState(beta, lse_l, ent, dbeta_dh)
        out, lse = launch.forward(q, k, v, mask, b, n, temp.beta if adaptive else None, spec)
        ctx.spec = spec
        ctx.has_mask = mask is not None
        ctx.save_for_backward(q, k, v, out, lse, b, n, mask, *(temp or ()))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        launch = _triton()
        q, k, v, out, lse, b, n, mask, *temp = ctx.saved_tensors
        temp = launch.TemperatureState(*temp) if temp else None
        if dlse is not None:
            dlse = dlse.contiguous()
        dq, dk, dv, db, dn = launch.backward(dout, q, k, v, out, lse, dlse, mask, b, n, temp, ctx.spec)
        return dq, dk, dv, db, dn, None, None, None, None, None, None, None


def flash_attention(q, k, v, b: Optional[torch.Tensor], n: Optional[torch.Tensor],
                    mask: Optional[torch.Tensor], scale: float, causal: bool, group: int,
                    adaptive: bool, poly: Sequence[float], threshold: float):
    """``(out, lse)`` through the Triton kernels, differentiable in q, k, v, b, n."""
    return FlashAttentionFunction.apply(q, k, v, b, n, mask, scale, causal, group, adaptive,
                                        tuple(poly), threshold)
