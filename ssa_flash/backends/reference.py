"""The reference backend: :class:`~ssa_flash.backends.spec.Backend` on materialised scores.

The forward reuses the specification's logit rows (``ssa_flash.reference``); the backward is
DESIGN.md 1.2 / 1.3 written out on whole ``(B, Hq, Lq, Lk)`` matrices, in the accumulation dtype
(float64 for float64 inputs, else float32), on any device and dtype. O(Lq * Lk) memory.

This is the form of the reference that the custom ops can call (an op's implementation runs with
autograd off, so a backend cannot differentiate a recomputed forward): it lets the op layer (the
adaptive-temperature host step, LSE gradients, empty rows) and callers of the backend interface be
tested without kernels. ``backend="reference"`` in the public functions does *not* come here: it
runs ``ssa_flash.reference`` under ordinary autograd (see ``ssa_flash.backends``).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import reference as spec_code
from .spec import AttentionSpec, TemperatureState, acc_dtype

__all__ = ["NAME", "unavailable_reason", "supports", "row_entropy", "forward", "backward", "row_dbeta",
           "backward_given_g"]

NAME = "reference"


def unavailable_reason(device: torch.device) -> Optional[str]:
    return None


def supports(q, k, v, spec: AttentionSpec) -> Optional[str]:
    return None


def _rows(q, k, mask, b, n, spec: AttentionSpec):
    """``(z, l, allowed)``: logits, logit rows ``phi(z) + mask`` (-inf where not admissible) and
    the admissible set, each ``(B, Hq, Lq, Lk)`` in the accumulation dtype."""
    acc = acc_dtype(q.dtype)
    qa, ka = q.to(acc), k.to(acc)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(acc)
    l, allowed = spec_code._logit_rows(qa, ka, mask, spec.causal, spec.scale, spec.group > 1, b, n,
                                       (spec.window_left, spec.window_right))
    kr = ka.repeat_interleave(spec.group, dim=1) if spec.group > 1 else ka
    z = spec.scale * (qa @ kr.transpose(-2, -1))
    return z, l, allowed


def _lse(s):
    """Row log-sum-exp; -inf for rows that are all -inf."""
    return torch.logsumexp(s, dim=-1)


def _tempered(l, allowed, beta):
    if beta is None:
        return l
    # zero the inadmissible entries first: beta * -inf is fine, but keep the masked value exact
    return (beta.unsqueeze(-1) * l.masked_fill(~allowed, 0.0)).masked_fill(~allowed, float("-inf"))


def _keep(shape, spec: AttentionSpec, device):
    """The dropout keep mask (the kernels' Philox mask for ``spec.dropout_rng``), or None."""
    if spec.dropout_p <= 0:
        return None
    seed, offset = spec.dropout_rng.tolist()
    return spec_code.dropout_keep_mask(seed, offset, shape, spec.dropout_p, device)


def _weights(s, allowed, lse):
    """``exp(s - lse)`` on admissible entries, else 0: the weights of rows whose log-sum-exp is
    ``lse`` (of all the keys, which may be more than those of ``s``); rows with ``lse = -inf``
    (no admissible key) get 0."""
    lse = lse.to(s.dtype).unsqueeze(-1)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(s - lse).masked_fill(~allowed, 0.0)


def _group_sum(x, group: int):
    """``(B, Hq, L, d)`` -> ``(B, Hkv, L, d)``: sums the query heads sharing a key/value head."""
    if group == 1:
        return x
    B, H, L, d = x.shape
    return x.view(B, H // group, group, L, d).sum(dim=2)


def row_entropy(q, k, mask, b, n, spec: AttentionSpec):
    _, l, allowed = _rows(q, k, mask, b, n, spec)
    return spec_code._entropy(l, allowed), _lse(l)


def forward(q, k, v, mask, b, n, beta, spec: AttentionSpec):
    _, l, allowed = _rows(q, k, mask, b, n, spec)
    s = _tempered(l, allowed, beta if spec.adaptive else None)
    p = spec_code._masked_softmax(s, allowed)
    keep = _keep(p.shape, spec, p.device)
    if keep is not None:
        p = spec_code._apply_dropout(p, spec.dropout_p, keep)
    va = v.to(p.dtype)
    vr = va.repeat_interleave(spec.group, dim=1) if spec.group > 1 else va
    return (p @ vr).to(q.dtype), _lse(s)


def backward(dout, q, k, v, out, lse, dlse, mask, b, n, temp: Optional[TemperatureState],
             spec: AttentionSpec):
    return _backward(dout, q, k, v, out, lse, dlse, mask, b, n, temp, spec)


# spec.KeyShardTemperature: the adaptive temperature's backward over a shard of the keys


def row_dbeta(dout, q, k, v, out, lse, dlse, mask, b, n, temp: TemperatureState, spec: AttentionSpec):
    return _backward(dout, q, k, v, out, lse, dlse, mask, b, n, temp, spec, dbeta_only=True)


def backward_given_g(dout, q, k, v, out, lse, dlse, mask, b, n, temp: TemperatureState, g,
                     spec: AttentionSpec):
    return _backward(dout, q, k, v, out, lse, dlse, mask, b, n, temp, spec, g=g)


def _backward(dout, q, k, v, out, lse, dlse, mask, b, n, temp, spec, g=None, dbeta_only=False):
    z, l, allowed = _rows(q, k, mask, b, n, spec)
    acc = z.dtype
    beta = temp.beta if spec.adaptive else None
    s = _tempered(l, allowed, beta)
    # P' = softmax(beta * l) normalised by the given lse: the whole row's, also for a key shard
    p_s = _weights(s, allowed, lse)
    do, o = dout.to(acc), out.to(acc)
    va = v.to(acc)
    vr = va.repeat_interleave(spec.group, dim=1) if spec.group > 1 else va

    keep = _keep(p_s.shape, spec, p_s.device)
    # dropout: out = (r M * P') V with r = 1 / (1 - p), so dV = (r M * P')^T dO, dP' = r M * (dO V^T)
    p_kept = p_s if keep is None else spec_code._apply_dropout(p_s, spec.dropout_p, keep)
    dv = _group_sum(p_kept.transpose(-2, -1) @ do, spec.group)
    delta = (do * o).sum(-1)
    if dlse is not None:  # d lse_i / d S'_ij = P'_ij
        delta = delta - dlse.to(acc)
    dp = do @ vr.transpose(-2, -1)
    if keep is not None:
        dp = spec_code._apply_dropout(dp, spec.dropout_p, keep)
    ds = p_s * (dp - delta.unsqueeze(-1))  # dS', 0 where inadmissible
    l0 = l.masked_fill(~allowed, 0.0)
    if spec.adaptive:
        dbeta = (ds * l0).sum(-1)
        if dbeta_only:
            return dbeta
        g = dbeta * temp.dbeta_dh if g is None else g.to(acc)
        p = _weights(l, allowed, temp.lse_l)  # P = softmax(l), the whole row's
        logp = (l - temp.lse_l.unsqueeze(-1)).masked_fill(~allowed, 0.0)
        dl = beta.unsqueeze(-1) * ds - g.unsqueeze(-1) * p * (logp + temp.entropy.unsqueeze(-1))
    else:
        dl = ds
    db = dn = None
    if b is not None:
        bh, nh = b.to(acc).view(1, -1, 1, 1), n.to(acc).view(1, -1, 1, 1)
        denom = 1.0 + bh * z.abs()
        db = (dl * nh * z / denom).sum(dim=(0, 2, 3))
        dn = (dl * torch.sign(z) * torch.log1p(bh * z.abs())).sum(dim=(0, 2, 3))
        dz = dl * (nh * bh / denom)
    else:
        dz = dl
    ka = k.to(acc)
    kr = ka.repeat_interleave(spec.group, dim=1) if spec.group > 1 else ka
    dq = spec.scale * (dz @ kr)
    dk = _group_sum(spec.scale * (dz.transpose(-2, -1) @ q.to(acc)), spec.group)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), db, dn
