"""The specification in code: naive attention with every score materialised.

Shapes follow ``torch.nn.functional.scaled_dot_product_attention``: ``query (B, Hq, Lq, D)``,
``key (B, Hkv, Lk, D)``, ``value (B, Hkv, Lk, Dv)``; the output is ``(B, Hq, Lq, Dv)``.
Everything is computed in the inputs' dtype (so this is also "the naive implementation in low
precision" that FlashAttention's error rule compares against); call it on float64 copies for a
gold standard. Memory is O(Lq * Lk): use it for testing, not for training.

Equations (see DESIGN.md, section 1):

* logits        ``z = scale * q k^T``
* SSA           ``phi(z) = n * sgn(z) * log1p(b |z|)``, i.e. weights ``(1 + b|z|)^(sgn(z) n)``
* logit row     ``l = phi(z) + mask``  (``phi = identity`` for softmax attention)
* weights       ``P = softmax(l)``; a row with no admissible key gets ``P = 0``
* adaptive      ``H = -sum P log P``; ``beta = max(poly(H), 1) if H > threshold else 1``;
                weights ``softmax(beta * l)`` (Velickovic et al. 2025, Fig. 4)
* packed batch  ``varlen_attention``: each sequence on its own, concatenated (DESIGN.md 1.5)
* KV cache      ``attention_with_kvcache``: each batch element over its valid cache rows,
                bottom-right causal alignment
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from .temperature import DEFAULT_POLY, DEFAULT_THRESHOLD, polyval

__all__ = [
    "ssa_attention",
    "softmax_attention",
    "adaptive_temperature_attention",
    "attention_entropy",
    "varlen_attention",
    "attention_with_kvcache",
    "ssa_logits",
    "DEFAULT_POLY",
    "DEFAULT_THRESHOLD",
]


Scalar = Union[float, Tensor]


def ssa_logits(z: Tensor, b: Tensor, n: Tensor) -> Tensor:
    """``phi(z) = n * sgn(z) * log1p(b|z|)``, written so that autograd's derivative at ``z = 0`` is
    the continuous limit ``n * b`` (``sign(z) * log1p(b * abs(z))`` would give 0 there)."""
    # each branch sees only its own sign (clamped), so the unused one cannot make 0 * inf = NaN
    # in the backward (log1p(-b z) at b z = 1)
    return n * torch.where(z >= 0, torch.log1p(b * z.clamp(min=0)), -torch.log1p(b * (-z).clamp(min=0)))


def _per_head(x: Scalar, heads: int, like: Tensor) -> Tensor:
    """A Python number or a tensor broadcastable to ``(heads,)``, as a ``(1, heads, 1, 1)`` tensor."""
    x = torch.as_tensor(x, dtype=like.dtype, device=like.device)
    return x.to(like.dtype).expand(heads).reshape(1, heads, 1, 1)


def _logit_rows(query, key, attn_mask, is_causal, scale, enable_gqa, b=None, n=None):
    """The logit rows ``l = phi(z) + mask`` (B, Hq, Lq, Lk) and the admissible set as a boolean."""
    hq, hk = query.shape[-3], key.shape[-3]
    if enable_gqa and hq != hk:
        key = key.repeat_interleave(hq // hk, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    z = scale * (query @ key.transpose(-2, -1))
    logits = z if b is None else ssa_logits(z, _per_head(b, hq, z), _per_head(n, hq, z))
    lq, lk = z.shape[-2], z.shape[-1]
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=z.device)
    if is_causal:
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=z.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            logits = logits + attn_mask.to(logits.dtype)
    allowed = allowed & (logits != float("-inf"))  # NaN stays admissible, so it propagates
    logits = logits.masked_fill(~allowed, float("-inf"))
    return logits, allowed.expand_as(logits)


def _masked_softmax(logits: Tensor, allowed: Tensor) -> Tensor:
    """softmax over the last dim; rows with no admissible entry give 0 (and zero gradients)."""
    empty = ~allowed.any(dim=-1, keepdim=True)
    probs = torch.softmax(logits.masked_fill(empty, 0.0), dim=-1)
    return probs.masked_fill(empty, 0.0)


def _entropy(logits: Tensor, allowed: Tensor) -> Tensor:
    """Exact entropy ``-sum p log p`` (natural log) of softmax(logits) per row; 0 for empty rows."""
    p = _masked_softmax(logits, allowed)
    empty = ~allowed.any(dim=-1, keepdim=True)
    logp = logits - torch.logsumexp(logits.masked_fill(empty, 0.0), dim=-1, keepdim=True)
    return -(p * logp.masked_fill(~allowed, 0.0)).sum(-1)


def _adaptive_beta(logits, allowed, poly, threshold):
    """The paper's Fig. 4: ``beta = max(poly(H), 1)`` where ``H > threshold``, else 1."""
    h = _entropy(logits, allowed)
    beta = torch.where(h > threshold, torch.clamp(polyval(poly, h), min=1.0), torch.ones_like(h))
    return beta


def _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
            b=None, n=None, adaptive=False, poly=DEFAULT_POLY, threshold=DEFAULT_THRESHOLD):
    if dropout_p != 0.0:
        raise NotImplementedError("dropout_p != 0 is not implemented")
    logits, allowed = _logit_rows(query, key, attn_mask, is_causal, scale, enable_gqa, b, n)
    if adaptive:
        beta = _adaptive_beta(logits, allowed, poly, threshold).unsqueeze(-1)
        # zero the inadmissible entries before scaling: d(beta * -inf)/d beta would be NaN
        logits = (beta * logits.masked_fill(~allowed, 0.0)).masked_fill(~allowed, float("-inf"))
    probs = _masked_softmax(logits, allowed)
    hq, hk = query.shape[-3], value.shape[-3]
    if enable_gqa and hq != hk:
        value = value.repeat_interleave(hq // hk, dim=-3)
    out = probs @ value
    if not return_lse:
        return out
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return out, torch.logsumexp(logits.to(lse_dtype), dim=-1)


def softmax_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                      scale=None, enable_gqa=False, *, return_lse=False, **_ignored):
    """Plain softmax attention (what SDPA computes), except that empty rows give 0, not NaN."""
    return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)


def ssa_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, *, b: Scalar = 1.0, n: Scalar = 1.5,
                  adaptive_temperature=False, poly=DEFAULT_POLY, threshold=DEFAULT_THRESHOLD,
                  return_lse=False, **_ignored):
    """SSA attention: weights ``(1 + b|z|)^(sgn(z) n)`` normalised over keys; ``b``, ``n`` per head."""
    return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                   return_lse, b=b, n=n, adaptive=adaptive_temperature, poly=poly,
                   threshold=threshold)


def adaptive_temperature_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                   is_causal=False, scale=None, enable_gqa=False, *,
                                   poly=DEFAULT_POLY, threshold=DEFAULT_THRESHOLD,
                                   return_lse=False, **_ignored):
    """Softmax attention with the entropy-driven temperature of "Softmax is not Enough"."""
    return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                   return_lse, adaptive=True, poly=poly, threshold=threshold)


def attention_entropy(query, key, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                      *, b: Optional[Scalar] = None, n: Optional[Scalar] = None) -> Tensor:
    """Per-row entropy (natural log) of the attention weights, ``(B, Hq, Lq)``; SSA if b, n given."""
    if (b is None) != (n is None):
        raise ValueError("attention_entropy: give both b and n (SSA) or neither (softmax)")
    logits, allowed = _logit_rows(query, key, attn_mask, is_causal, scale, enable_gqa, b, n)
    return _entropy(logits, allowed)


def _no_dropout_or_window(dropout_p, window_size):
    if dropout_p != 0.0:
        raise ValueError("dropout_p != 0 is not implemented for packed batches and KV caches yet")
    if tuple(window_size) != (-1, -1):
        raise ValueError("window_size is not implemented for packed batches and KV caches yet")


def _one_sequence(q, k, v, mask, is_causal, scale, enable_gqa, ssa, b, n, adaptive, poly, threshold):
    """``(out, lse)`` of ``(1, Hq, Lq, D)`` queries over ``(1, Hkv, Lk, D)`` keys; no key: 0, -inf."""
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if k.shape[2] == 0:
        out = q.new_zeros((*q.shape[:-1], v.shape[-1])) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()
        return out, torch.full(q.shape[:-1], float("-inf"), dtype=lse_dtype, device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _attend(q, k, v, mask, 0.0, is_causal, scale, enable_gqa, True,
                   b=b if ssa else None, n=n if ssa else None, adaptive=adaptive, poly=poly,
                   threshold=threshold)


def varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *, ssa=True,
                     b: Scalar = 1.0, n: Scalar = 1.5, adaptive_temperature=False, poly=DEFAULT_POLY,
                     threshold=DEFAULT_THRESHOLD, window_size=(-1, -1), return_lse=False, **_ignored):
    """Packed variable-length batch: ``query (total_q, Hq, D)``, ``key (total_k, Hkv, D)``, ``value
    (total_k, Hkv, Dv)``; sequence ``s`` is query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` attending
    to key rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``, with every rule (causality top-left, as in
    ``ssa_attention``) applied inside the sequence. ``ssa=False``: softmax logits. Returns ``out
    (total_q, Hq, Dv)`` and, with ``return_lse``, ``lse (Hq, total_q)``. The ``max_seqlen_*`` are
    not needed here. Each sequence runs on its own (a loop), differentiably."""
    _no_dropout_or_window(dropout_p, window_size)
    cq, ck = [int(x) for x in cu_seqlens_q.tolist()], [int(x) for x in cu_seqlens_k.tolist()]
    outs, lses = [], []
    for s in range(len(cq) - 1):
        if cq[s + 1] == cq[s]:
            continue
        q_s = query[cq[s]:cq[s + 1]].transpose(0, 1).unsqueeze(0)
        k_s = key[ck[s]:ck[s + 1]].transpose(0, 1).unsqueeze(0)
        v_s = value[ck[s]:ck[s + 1]].transpose(0, 1).unsqueeze(0)
        o, lse = _one_sequence(q_s, k_s, v_s, None, is_causal, scale, enable_gqa, ssa, b, n,
                               adaptive_temperature, poly, threshold)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = torch.cat(outs) if outs else query.new_zeros((0, query.shape[1], value.shape[-1]))
    lse = torch.cat(lses, dim=1) if lses else torch.zeros((query.shape[1], 0), dtype=lse_dtype, device=query.device)
    return (out, lse) if return_lse else out


def attention_with_kvcache(query, k_cache, v_cache, cache_seqlens, key=None, value=None, *,
                           is_causal=False, scale=None, enable_gqa=False, ssa=True, b: Scalar = 1.0,
                           n: Scalar = 1.5, adaptive_temperature=False, poly=DEFAULT_POLY,
                           threshold=DEFAULT_THRESHOLD, window_size=(-1, -1), return_lse=False,
                           cache_leftpad=None, **_ignored):
    """Attention of ``query (B, Hq, Lq, D)`` over a KV cache ``(B, Hkv, Lcache, D)`` of which batch
    element ``b`` holds ``cache_seqlens[b]`` valid rows. New ``key``/``value`` ``(B, Hkv, Lnew, D)``
    are first written into the caches in place at rows ``cache_seqlens[b]:cache_seqlens[b]+Lnew``
    and attended too. With ``cache_leftpad`` (B,) rows before ``cache_leftpad[b]`` are not attended.
    ``is_causal`` is bottom-right: query ``i`` is at cache position ``cache_len - Lq + i`` (``cache_len
    = cache_seqlens[b] + Lnew``) and sees the rows up to it. Returns ``out (B, Hq, Lq, Dv)`` (and
    ``lse (B, Hq, Lq)``); a batch element with no row to attend gets 0 (lse -inf)."""
    _no_dropout_or_window(0.0, window_size)
    lengths = [int(x) for x in cache_seqlens.tolist()]
    starts = [0] * len(lengths) if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
    if key is not None:
        for i, length in enumerate(lengths):
            k_cache[i, :, length:length + key.shape[2]] = key[i]
            v_cache[i, :, length:length + value.shape[2]] = value[i]
        lengths = [length + key.shape[2] for length in lengths]
    outs, lses = [], []
    Lq = query.shape[2]
    for i, (start, end) in enumerate(zip(starts, lengths)):
        k_s, v_s = k_cache[i:i + 1, :, start:end], v_cache[i:i + 1, :, start:end]
        mask = None
        if is_causal:
            mask = torch.arange(end - start, device=query.device)[None, :] <= (
                torch.arange(Lq, device=query.device)[:, None] + (end - start - Lq))
        o, lse = _one_sequence(query[i:i + 1], k_s, v_s, mask, False, scale, enable_gqa, ssa, b, n,
                               adaptive_temperature, poly, threshold)
        outs.append(o)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) if return_lse else out
