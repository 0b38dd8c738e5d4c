"""The reference backend: :class:`~ssa_flash.spec.Backend` on materialised scores.

The forward reuses the specification's logit rows (``ssa_flash.reference``); the backward is
docs/design.md §1.2 / §1.3 written out on whole ``(B, Hq, Lq, Lk)`` matrices, in the accumulation dtype
(float64 for float64 inputs, else float32), on any device and dtype. O(Lq * Lk) memory.

Packed batches and KV caches (``spec.packed``, ``spec.kv_cache``) run the dense computation on
each sequence in turn (lengths read on the host).

This is the form of the reference that the custom ops can call (an op's implementation runs with
autograd off, so a backend cannot differentiate a recomputed forward): ``backend="reference"`` in
the public functions and every degenerate call (no query rows, keys or head dim, where kernels
launch nothing) run here through the custom ops like any other backend, so the op layer (the
adaptive-temperature host step, LSE gradients, empty rows, a learned mask's gradient) is tested
without kernels. ``ssa_flash.reference`` under autograd stays the specification it is held to.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import reference as spec_code
from .. import scores
from ..spec import AttentionSpec, TemperatureState, acc_dtype

__all__ = ["NAME", "unavailable_reason", "supports", "row_entropy", "forward", "backward", "row_dbeta",
           "backward_given_g", "dropout_mask"]

NAME = "reference"


def unavailable_reason(device: torch.device) -> Optional[str]:
    return None


def supports(q, k, v, spec: AttentionSpec, sinks=None) -> Optional[str]:
    return scores.unknown(spec.score) if spec.score_fn is None else None


def _rows(q, k, mask, params, sinks, spec: AttentionSpec):
    """``(z, l, allowed)``: the scaled scores ``z = scale q k^T`` (before any soft-capping),
    ``(B, Hq, Lq, Lk)``, and the logit rows ``phi(cap(z)) + mask`` (-inf where not admissible)
    with the admissible set, ``(B, Hq, Lq, Lk)``, or ``(B, Hq, Lq, Lk + 1)`` with the sink as the
    last column when ``sinks`` is given; all in the accumulation dtype."""
    acc = acc_dtype(q.dtype)
    qa, ka = q.to(acc), k.to(acc)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(acc)
    l, allowed = spec_code._logit_rows(qa, ka, mask, spec.causal, spec.scale, spec.group > 1,
                                       spec.score_fn, params, (spec.window_left, spec.window_right),
                                       spec.softcap)
    if sinks is not None:
        l, allowed = spec_code._with_sink(l, allowed, sinks.to(acc))
    kr = ka.repeat_interleave(spec.group, dim=1) if spec.group > 1 else ka
    z = spec.scale * (qa @ kr.transpose(-2, -1))
    return z, l, allowed


def _lse(s):
    """Row log-sum-exp; -inf for rows that are all -inf."""
    return torch.logsumexp(s, dim=-1)


def _tempered(l, allowed, beta):
    """``(s_rel, off)``: the (tempered) row ``s = beta * l`` as ``s_rel + off`` with ``off`` its
    row maximum (0 for an empty row), so that ``s_rel`` is finite wherever ``l`` is, also where
    ``beta * l`` alone would overflow (a finite mask at ``finfo.min``: docs/api.md, fully
    masked rows); ``-inf`` where inadmissible. ``beta`` None: ``s = l``."""
    off = spec_code._row_offset(l, allowed)
    rel = (l - off.unsqueeze(-1)).masked_fill(~allowed, 0.0)
    if beta is not None:  # (beta * off saturated at the dtype's lowest: the LSE stays finite)
        rel, off = beta.unsqueeze(-1) * rel, (beta * off).clamp(min=torch.finfo(off.dtype).min)
    return rel.masked_fill(~allowed, float("-inf")), off


def _row_lse(s_rel, off):
    """The LSE of the rows ``s_rel + off`` (:func:`_tempered`)."""
    return _lse(s_rel) + off


def _keep(shape, spec: AttentionSpec, device):
    """The dropout keep mask (the kernels' Philox mask for ``spec.dropout_rng``), or None."""
    if spec.dropout_p <= 0:
        return None
    seed, offset = spec.dropout_rng.tolist()
    return spec_code.dropout_keep_mask(seed, offset, shape, spec.dropout_p, device)


def _weights(s_rel, off, allowed, lse):
    """``(P, log P)``: ``exp(s - lse)`` and ``s - lse`` on admissible entries (else 0) of the
    rows ``s = s_rel + off`` (:func:`_tempered`) whose log-sum-exp is ``lse`` (of all the keys,
    which may be more than those of ``s``); rows with ``lse = -inf`` (no admissible key) get 0.

    Where the keys given are the whole row (their own LSE equals ``lse`` up to its rounding) the
    row's own LSE is used: a huge ``off`` (a finite mask at ``finfo.min``) leaves ``lse`` no
    digits for ``log(sum)``, so ``s - lse`` would lose the row's normalisation."""
    lse = lse.to(s_rel.dtype)
    own_rel = _lse(s_rel)
    own = own_rel + off
    eps = torch.finfo(lse.dtype).eps
    whole = torch.isfinite(own) & ((own - lse).abs() <= (lse.abs() + 1.0) * (4 * eps))
    rel = torch.where(whole, own_rel, lse - off)
    rel = torch.where(torch.isfinite(rel), rel, torch.zeros_like(rel)).unsqueeze(-1)
    logp = (s_rel - rel).masked_fill(~allowed, 0.0)
    return torch.exp(logp).masked_fill(~allowed, 0.0), logp


def _group_sum(x, group: int):
    """``(B, Hq, L, d)`` -> ``(B, Hkv, L, d)``: sums the query heads sharing a key/value head."""
    if group == 1:
        return x
    B, H, L, d = x.shape
    return x.view(B, H // group, group, L, d).sum(dim=2)


# --------------------------------------------------------------------------------------------
# Packed batches and KV caches: the dense computation on each sequence, one at a time


def _dense(spec: AttentionSpec, causal: bool, sequence: int = 0) -> AttentionSpec:
    """The dense spec of one sequence. Dropout: sequence ``s`` of a packed batch is batch element
    ``s`` of the dense rule, i.e. its Philox counter's batch word is ``s + offset``: the offset
    moved by ``s`` makes it element 0 of its own call."""
    rng = spec.dropout_rng
    if rng is not None and sequence:
        rng = rng + torch.tensor([0, sequence], dtype=rng.dtype, device=rng.device)
    return dataclasses.replace(spec, causal=causal, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                               max_seqlen_k=0, seqused_k=None, k_start=None, num_splits=0, dropout_rng=rng)


def _pieces(q, k, spec: AttentionSpec):
    """Per sequence ``(rows, q_s, k_slice, mask, dense_spec)``: ``rows`` selects its query rows in
    the outputs (packed: ``(slice over tokens, None)``; KV cache: ``(None, batch index)``), ``q_s``
    is ``(1, Hq, Lq_s, D)``, ``k_slice`` selects its keys, ``mask`` is None or the bottom-right
    causal / window mask of a KV cache. Reads the lengths on the host (a reference, not a kernel)."""
    out = []
    if spec.packed:
        cq, ck = spec.cu_seqlens_q.tolist(), spec.cu_seqlens_k.tolist()
        for s in range(len(cq) - 1):
            if cq[s + 1] > cq[s]:
                out.append(((slice(cq[s], cq[s + 1]), None), q[cq[s]:cq[s + 1]].transpose(0, 1).unsqueeze(0),
                            slice(ck[s], ck[s + 1]), None, _dense(spec, spec.causal, s)))
        return out
    used = spec.seqused_k.tolist()
    starts = spec.k_start.tolist() if spec.k_start is not None else [0] * len(used)
    Lq, Lk = q.shape[2], k.shape[2]
    dense = dataclasses.replace(_dense(spec, False), window_left=-1, window_right=-1)
    for i, (u, st) in enumerate(zip(used, starts)):
        end = min(max(u, 0), Lk)
        start = min(max(st, 0), end)
        mask = None
        if spec.causal or spec.window:  # bottom-right, the window too
            mask = spec_code._bottom_right_band(Lq, end - start, spec.causal, (spec.window_left, spec.window_right),
                                                q.device)
        out.append(((None, i), q[i:i + 1], slice(start, end), mask, dense))
    return out


def _keys(x, spec: AttentionSpec, rows, k_slice):
    """The keys (or values) of one sequence, ``(1, Hkv, Lk_s, d)``."""
    if spec.packed:
        return x[k_slice].transpose(0, 1).unsqueeze(0)
    return x[rows[1]:rows[1] + 1, :, k_slice]


def _rows_of(x, spec: AttentionSpec, rows, stat: bool):
    """Sequence ``rows`` of an output (``stat``: a per-row statistic) as a dense ``(1, H, Lq_s, ...)``."""
    if spec.packed:
        return x[:, rows[0]].unsqueeze(0) if stat else x[rows[0]].transpose(0, 1).unsqueeze(0)
    return x[rows[1]:rows[1] + 1]


def _put(dst, spec: AttentionSpec, rows, value, stat: bool):
    if spec.packed:
        if stat:
            dst[:, rows[0]] = value[0]
        else:
            dst[rows[0]] = value[0].transpose(0, 1)
    else:
        dst[rows[1]:rows[1] + 1] = value


def _layout_rows(q, k, mask, params, spec: AttentionSpec, fn, n_stats: int, out_dim=None):
    """Runs ``fn(q_s, k_slice, mask_s, dense_spec, rows)`` per sequence and assembles its
    ``n_stats`` per-row statistics (and, with ``out_dim``, an output first). Every row belongs to
    exactly one sequence (packed: the cu_seqlens cover the tokens; KV cache: one per batch element)."""
    acc = acc_dtype(q.dtype)
    row_shape = (q.shape[1], q.shape[0]) if spec.packed else tuple(q.shape[:-1])
    stats = [torch.zeros(row_shape, dtype=acc, device=q.device) for _ in range(n_stats)]
    out = None
    if out_dim is not None:
        out = q.new_zeros((*q.shape[:-1], out_dim))
    for rows, q_s, k_slice, m, dspec in _pieces(q, k, spec):
        res = fn(q_s, k_slice, m, dspec, rows)
        if out is not None:
            _put(out, spec, rows, res[0], False)
            res = res[1:]
        for dst, val in zip(stats, res):
            _put(dst, spec, rows, val, True)
    return out, stats


def _empty_row_stats(q_s, acc):
    shape = q_s.shape[:-1]
    return torch.zeros(shape, dtype=acc, device=q_s.device), torch.full(shape, float("-inf"), dtype=acc, device=q_s.device)


def row_entropy(q, k, mask, params, sinks, spec: AttentionSpec):
    if spec.packed or spec.kv_cache:
        def fn(q_s, k_slice, m, dspec, rows):
            k_s = _keys(k, spec, rows, k_slice)
            if k_s.shape[2] == 0 and sinks is None:  # no key: entropy 0, lse -inf
                return _empty_row_stats(q_s, acc_dtype(q.dtype))
            return row_entropy(q_s, k_s, None if m is None else m.expand(1, q_s.shape[1], *m.shape), params,
                               sinks, dspec)

        _, (ent, lse_l) = _layout_rows(q, k, mask, params, spec, fn, 2)
        return ent, lse_l
    _, l, allowed = _rows(q, k, mask, params, sinks, spec)
    return spec_code._entropy(l, allowed), _row_lse(*_tempered(l, allowed, None))


def forward(q, k, v, mask, params, sinks, beta, spec: AttentionSpec):
    if spec.packed or spec.kv_cache:
        def fn(q_s, k_slice, m, dspec, rows):
            k_s, v_s = _keys(k, spec, rows, k_slice), _keys(v, spec, rows, k_slice)
            if k_s.shape[2] == 0 and sinks is None:  # no key: output 0, lse -inf
                return (q_s.new_zeros((*q_s.shape[:-1], v.shape[-1])), _empty_row_stats(q_s, acc_dtype(q.dtype))[1])
            beta_s = _rows_of(beta, spec, rows, True) if spec.adaptive else None
            m4 = None if m is None else m.expand(1, q_s.shape[1], *m.shape)
            return forward(q_s, k_s, v_s, m4, params, sinks, beta_s, dspec)

        out, (lse,) = _layout_rows(q, k, mask, params, spec, fn, 1, out_dim=v.shape[-1])
        return out, lse
    _, l, allowed = _rows(q, k, mask, params, sinks, spec)
    s, off = _tempered(l, allowed, beta if spec.adaptive else None)
    p = spec_code._masked_softmax(s, allowed)
    if sinks is not None:
        p = p[..., :-1]  # the sink's value vector is zero
    keep = _keep(p.shape, spec, p.device)
    if keep is not None:
        p = spec_code._apply_dropout(p, spec.dropout_p, keep)
    va = v.to(p.dtype)
    vr = va.repeat_interleave(spec.group, dim=1) if spec.group > 1 else va
    return (p @ vr).to(q.dtype), _row_lse(s, off)


def _backward_packed(dout, q, k, v, out, lse, dlse, params, sinks, temp, spec: AttentionSpec):
    acc = acc_dtype(q.dtype)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dparams = [torch.zeros(q.shape[1], dtype=acc, device=q.device) for _ in params]
    dsinks = None if sinks is None else torch.zeros(q.shape[1], dtype=acc, device=q.device)
    for rows, q_s, k_slice, _, dspec in _pieces(q, k, spec):
        k_s, v_s = _keys(k, spec, rows, k_slice), _keys(v, spec, rows, k_slice)
        if k_s.shape[2] == 0 and sinks is None:
            continue  # no key: zero gradients (with a sink, the sink still has one)
        sub = lambda x: None if x is None else _rows_of(x, spec, rows, x.dim() == 2)  # noqa: E731
        temp_s = TemperatureState(*(sub(t) for t in temp)) if spec.adaptive else None
        g = backward(sub(dout), q_s, k_s, v_s, sub(out), sub(lse), sub(dlse), None, params, sinks, temp_s, dspec)
        dq[rows[0]] = g[0][0].transpose(0, 1)
        dk[k_slice] = g[1][0].transpose(0, 1)
        dv[k_slice] = g[2][0].transpose(0, 1)
        dparams = [a + b for a, b in zip(dparams, g[3])]
        if sinks is not None:
            dsinks = dsinks + g[4]
    return dq, dk, dv, tuple(dparams), dsinks


def backward(dout, q, k, v, out, lse, dlse, mask, params, sinks, temp: Optional[TemperatureState],
             spec: AttentionSpec, mask_grad_shape=None):
    if spec.kv_cache:
        raise NotImplementedError("ssa_flash: the KV-cache layout (decoding) is forward only")
    if spec.packed:
        if mask_grad_shape is not None:
            raise ValueError("ssa_flash: a packed batch takes no attn_mask, so no mask gradient")
        return _backward_packed(dout, q, k, v, out, lse, dlse, params, sinks, temp, spec)
    return _backward(dout, q, k, v, out, lse, dlse, mask, params, sinks, temp, spec,
                     mask_grad_shape=mask_grad_shape)


def dropout_mask(rng, shape, dropout_p: float) -> Tensor:
    """The kernels' dropout keep-mask ``(B, H, Lq, Lk)`` (bool) for the ``(seed, offset)`` tensor
    ``rng``: the specification's Philox (``ssa_flash.reference.dropout_keep_mask``), as
    ``triton_backend.dropout_mask`` (not part of :class:`~ssa_flash.spec.Backend`)."""
    seed, offset = rng.tolist()
    return spec_code.dropout_keep_mask(seed, offset, shape, dropout_p, rng.device)


# spec.KeyShardTemperature: the adaptive temperature's backward over a shard of the keys (no
# sinks: a caller holding key shards adds the sink's terms once per row itself)


def row_dbeta(dout, q, k, v, out, lse, dlse, mask, params, temp: TemperatureState, spec: AttentionSpec):
    return _backward(dout, q, k, v, out, lse, dlse, mask, params, None, temp, spec, dbeta_only=True)


def backward_given_g(dout, q, k, v, out, lse, dlse, mask, params, temp: TemperatureState, g,
                     spec: AttentionSpec):
    return _backward(dout, q, k, v, out, lse, dlse, mask, params, None, temp, spec, g=g)[:4]


def _score_vjp(dl, zc, params, spec: AttentionSpec) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """``(dz, dparams)``: the logit gradient ``dl`` pulled back through the score function,
    ``dz = dl * dphi/dz`` and ``dparam_h = sum_{b,i,j} dl * dphi/dparam`` over head ``h``, with the
    registry's derivatives (``scores.ScoreFunction.derivatives``). ``zc`` is the (capped) scaled
    score; everything in the accumulation dtype."""
    dphi_dz, dphi_dparams = spec.score_fn.derivatives(zc, *(p.to(zc.dtype).view(1, -1, 1, 1) for p in params))
    return dl * dphi_dz, tuple((dl * d).sum(dim=(0, 2, 3)) for d in dphi_dparams)


def _sum_to(x: Tensor, shape) -> Tensor:
    """``x (B, Hq, Lq, Lk)`` summed over the dims where ``shape`` (4-D) broadcasts (has a 1)."""
    dims = [i for i, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1]
    return x.sum(dim=dims, keepdim=True) if dims else x


def _backward(dout, q, k, v, out, lse, dlse, mask, params, sinks, temp, spec, g=None, dbeta_only=False,
              mask_grad_shape=None):
    z, l, allowed = _rows(q, k, mask, params, sinks, spec)
    acc = z.dtype
    lk = z.shape[-1]  # keys; l, allowed have one more column (the sink) with sinks
    beta = temp.beta if spec.adaptive else None
    s, off = _tempered(l, allowed, beta)
    # P' = softmax(beta * l) normalised by the given lse: the whole row's, also for a key shard
    p_s, _ = _weights(s, off, allowed, lse)
    do, o = dout.to(acc), out.to(acc)
    va = v.to(acc)
    vr = va.repeat_interleave(spec.group, dim=1) if spec.group > 1 else va

    p_keys = p_s[..., :lk]
    keep = _keep(p_keys.shape, spec, p_s.device)
    # dropout: out = (r M * P') V with r = 1 / (1 - p), so dV = (r M * P')^T dO, dP' = r M * (dO V^T)
    p_kept = p_keys if keep is None else spec_code._apply_dropout(p_keys, spec.dropout_p, keep)
    dv = _group_sum(p_kept.transpose(-2, -1) @ do, spec.group)
    delta = (do * o).sum(-1)
    if dlse is not None:  # d lse_i / d S'_ij = P'_ij
        delta = delta - dlse.to(acc)
    dp = do @ vr.transpose(-2, -1)
    if keep is not None:
        dp = spec_code._apply_dropout(dp, spec.dropout_p, keep)
    if sinks is not None:  # the sink's value vector is zero: dP'_sink = 0
        dp = torch.cat([dp, dp.new_zeros((*dp.shape[:-1], 1))], dim=-1)
    ds = p_s * (dp - delta.unsqueeze(-1))  # dS', 0 where inadmissible
    if spec.adaptive:
        lse_l = temp.lse_l.to(acc)
        lse_l = torch.where(torch.isfinite(lse_l), lse_l, torch.zeros_like(lse_l))
        p, logp = _weights(*_tempered(l, allowed, None), allowed, temp.lse_l)  # P = softmax(l), the whole row's
        # dbeta_i = sum_j dS'_ij l_ij summed centred (spec.KeyShardTemperature.row_dbeta): since
        # sum_j dS'_ij = dlse_i, it is sum_j dS'_ij (l_ij - lse^l_i) + lse^l_i dlse_i
        dbeta = (ds * logp).sum(-1)
        if dbeta_only:
            return dbeta
        if dlse is not None:
            dbeta = dbeta + lse_l * dlse.to(acc)
        g = dbeta * temp.dbeta_dh if g is None else g.to(acc)
        dl = beta.unsqueeze(-1) * ds - g.unsqueeze(-1) * p * (logp + temp.entropy.unsqueeze(-1))
    else:
        dl = ds
    dsinks = None
    if sinks is not None:  # the sink is a logit of its own: d loss / d s_h sums its dl over the rows
        dsinks = dl[..., lk].sum(dim=(0, 2))
        dl = dl[..., :lk]
    zc = z
    if spec.softcap > 0:  # z -> c tanh(z / c): phi sees the capped score, dz gets 1 - tanh^2
        t = torch.tanh(z / spec.softcap)
        zc = spec.softcap * t
    dz, dparams = _score_vjp(dl, zc, params, spec)
    if spec.softcap > 0:
        dz = dz * (1.0 - t * t)
    ka = k.to(acc)
    kr = ka.repeat_interleave(spec.group, dim=1) if spec.group > 1 else ka
    dq = spec.scale * (dz @ kr)
    dk = _group_sum(spec.scale * (dz.transpose(-2, -1) @ q.to(acc)), spec.group)
    if mask_grad_shape is not None:  # l = phi(z) + mask: a learned mask's gradient is dl
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dparams, dsinks, _sum_to(dl, mask_grad_shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dparams, dsinks
