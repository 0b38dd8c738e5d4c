"""The specification in code: naive attention with every score materialised.

Shapes follow ``torch.nn.functional.scaled_dot_product_attention``: ``query (B, Hq, Lq, D)``,
``key (B, Hkv, Lk, D)``, ``value (B, Hkv, Lk, Dv)``; the output is ``(B, Hq, Lq, Dv)``.
Everything is computed in the inputs' dtype (so this is also "the naive implementation in low
precision" that FlashAttention's error rule compares against); call it on float64 copies for a
gold standard. Memory is O(Lq * Lk): use it for testing, not for training.

The surface (what the tests hold the backends to): :func:`attention` (one function for every
variant: ``score=`` / ``score_params=``, ``adaptive_temperature=``, masks, windows, dropout,
sinks, soft-capping), :func:`attention_entropy`, :func:`varlen_attention` and
:func:`attention_with_kvcache` (loops over :func:`attention`), and the dropout bits
(:func:`dropout_keep_mask`, :func:`philox4x32_10`). It is plain PyTorch under ordinary autograd
(differentiable to any order); ``backend="reference"`` in the public functions runs its
explicit-backward form, ``ssa_flash.backends.reference_backend``.

Equations (see docs/maths.md):

* logits        ``z = scale * q k^T``
* soft-capping  ``softcap = c > 0``: ``z <- c * tanh(z / c)`` before anything else (0: off)
* score         ``phi``, the score function (``ssa_flash.scores``, where each is defined):
                softmax ``phi(z) = z``; SSA ``phi(z) = n * sgn(z) * log1p(b |z|)``, i.e. weights
                ``(1 + b|z|)^(sgn(z) n)``; the logit scale ``phi(z) = s z``; per-head parameters
* logit row     ``l = phi(z) + mask``
* admissible    key ``j`` for query ``i``: ``j <= i`` if causal, ``i - left <= j <= i + right``
                for ``window_size = (left, right)`` (-1: that side unbounded), the boolean mask
* weights       ``P = softmax(l)``; a row with no admissible key gets ``P = 0``
* sinks         ``sinks = s`` (per query head): every row of head ``h`` gets one more logit ``s_h``
                whose value is 0: ``P = softmax([l, s_h])`` without its last column, so a row
                sums to ``1 - P_sink`` (a row with no admissible key: all on the sink, output 0)
* adaptive      ``H = -sum P log P``; ``beta = max(poly(H), 1) if H > threshold else 1``;
                weights ``softmax(beta * l)`` (Velickovic et al. 2025, Fig. 4); with sinks the
                row is ``[l, s_h]``: the sink counts in ``H`` and is tempered too
* LSE           ``logsumexp`` of the row normalised (tempered, with the sink)
* packed batch  ``varlen_attention``: each sequence on its own, concatenated
* KV cache      ``attention_with_kvcache``: each batch element over its valid cache rows,
                bottom-right causal alignment
* dropout       final weights ``P * M / (1 - p)`` with the keep mask ``M`` (0 if ``p = 1``);
                the LSE is the undropped row's. ``M`` is :func:`dropout_keep_mask`, the kernels'
                Philox mask, unless a mask is given (``dropout_mask=``). The sink is not subject
                to dropout (it has no value, so it would not change the output; the keep mask
                has one entry per key, none for the sink)
"""
from __future__ import annotations

import math
from typing import Union

import torch
from torch import Tensor

from . import scores
from .conventions import DEFAULT_POLY, DEFAULT_THRESHOLD, dropout_keep_threshold
from .spec import draw_dropout_rng
from .temperature import polyval

__all__ = [
    "attention",
    "attention_entropy",
    "varlen_attention",
    "attention_with_kvcache",
    "dropout_keep_mask",
    "philox4x32_10",
    "window_band",
]


Scalar = Union[float, Tensor]


# --------------------------------------------------------------------------------------------
# Dropout bits: Philox4x32-10, written with int64 tensor ops (every product below 2^49)

_M32 = 0xFFFFFFFF


def _mulhilo32(a: Tensor, m: int):
    """``(hi, lo)`` 32-bit halves of ``a * m`` for int64 ``a`` in [0, 2^32) and ``m < 2^32``."""
    t = a * (m & 0xFFFF)
    u = a * (m >> 16) + (t >> 16)
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def philox4x32_10(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: int, k1: int):
    """Philox4x32-10 (Salmon et al., SC 2011; Random123's ``philox4x32_R(10)``) of the counter
    words ``c0..c3`` (int64 tensors holding uint32 values) under the key ``(k0, k1)``."""
    for _ in range(10):
        hi0, lo0 = _mulhilo32(c0, 0xD2511F53)
        hi1, lo1 = _mulhilo32(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def dropout_keep_mask(seed: int, offset: int, shape, dropout_p: float, device=None) -> Tensor:
    """The dropout keep-mask ``(B, H, Lq, Lk)`` (bool) of the kernels for ``(seed, offset)``:
    element ``(b, h, i, j)`` is kept iff word ``bit3(i) + 2 bit0(j)`` of Philox4x32-10 with key
    ``seed`` (64 bits, low word first) and counter ``(j // 2, (i // 16) 8 + i % 8, h,
    (b + offset) mod 2^32)`` is below ``2 * dropout_keep_threshold(dropout_p)`` (one Philox
    evaluation serves ``{i, i + 8} x {j, j + 1}``). A function of the indices only, not of any
    tiling. O(B H Lq Lk) memory: for tests."""
    B, H, Lq, Lk = (int(x) for x in shape)
    seed, offset = int(seed), int(offset)
    i = torch.arange(Lq, dtype=torch.int64, device=device)
    j = torch.arange(Lk, dtype=torch.int64, device=device)
    full = (B, H, Lq, Lk)
    c0 = (j // 2).view(1, 1, 1, Lk).expand(full)
    c1 = ((i // 16) * 8 + i % 8).view(1, 1, Lq, 1).expand(full)
    c2 = torch.arange(H, dtype=torch.int64, device=device).view(1, H, 1, 1).expand(full)
    c3 = ((torch.arange(B, dtype=torch.int64, device=device) + offset) & _M32).view(B, 1, 1, 1).expand(full)
    words = torch.stack(philox4x32_10(c0, c1, c2, c3, seed & _M32, (seed >> 32) & _M32), dim=-1)
    lane = (((i >> 3) & 1).view(Lq, 1) + 2 * (j & 1).view(1, Lk)).expand(full)
    r = words.gather(-1, lane.unsqueeze(-1)).squeeze(-1)
    return r < 2 * dropout_keep_threshold(dropout_p)


def _apply_dropout(probs: Tensor, dropout_p: float, keep: Tensor) -> Tensor:
    """``probs * keep / (1 - dropout_p)``, zeros for ``dropout_p = 1`` (still differentiable)."""
    if dropout_p >= 1.0:
        return probs * 0.0
    return torch.where(keep, probs * (1.0 / (1.0 - dropout_p)), 0.0)


# --------------------------------------------------------------------------------------------
# Attention


def _per_head(x: Scalar, heads: int, like: Tensor) -> Tensor:
    """A Python number or a tensor broadcastable to ``(heads,)``, as a ``(1, heads, 1, 1)`` tensor."""
    x = torch.as_tensor(x, dtype=like.dtype, device=like.device)
    return x.to(like.dtype).expand(heads).reshape(1, heads, 1, 1)


def window_band(lq: int, lk: int, window_size, device=None, offset: int = 0) -> Tensor:
    """``(Lq, Lk)`` bool: ``p_i - left <= j <= p_i + right`` for ``window_size = (left, right)``, a
    side of -1 being unbounded, with query ``i`` at key position ``p_i = i + offset`` (0: top-left
    aligned, like ``is_causal``; ``Lk - Lq``: bottom-right, a KV cache's)."""
    left, right = window_size
    i = torch.arange(lq, device=device).view(lq, 1) + offset
    j = torch.arange(lk, device=device).view(1, lk)
    band = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if left >= 0:
        band = band & (j >= i - left)
    if right >= 0:
        band = band & (j <= i + right)
    return band


def _bottom_right_band(lq: int, lk: int, is_causal: bool, window_size, device=None) -> Tensor:
    """``(Lq, Lk)`` bool, the keys query ``i`` of a KV cache sees: causality and ``window_size``
    bottom-right aligned (query ``i`` at key position ``Lk - Lq + i``)."""
    band = window_band(lq, lk, window_size, device, offset=lk - lq)
    return band & window_band(lq, lk, (-1, 0), device, offset=lk - lq) if is_causal else band


def _check_softcap(softcap) -> float:
    softcap = float(softcap)
    if not softcap >= 0.0:  # also NaN
        raise ValueError(f"softcap must be >= 0 (0: no soft-capping), got {softcap}")
    return softcap


def _score_of(score, score_params):
    """``(ScoreFunction, params)``: ``score`` (a name; None: softmax) with ``score_params`` (a
    mapping by parameter name or a sequence in the registry's order)."""
    f = scores.get("softmax" if score is None else score)
    given = score_params if score_params is not None else ()
    if isinstance(given, dict):
        missing = [p for p in f.params if p not in given]
        if missing or len(given) != len(f.params):
            raise ValueError(f"score {f.name!r} takes parameters {f.params}, got {tuple(given)}")
        given = tuple(given[p] for p in f.params)
    if len(given) != len(f.params):
        raise ValueError(f"score {f.name!r} takes parameters {f.params}, got {len(given)} values")
    return f, tuple(given)


def _logit_rows(query, key, attn_mask, is_causal, scale, enable_gqa, score=scores.SOFTMAX, params=(),
                window_size=(-1, -1), softcap=0.0):
    """The logit rows ``l = phi(cap(z)) + mask`` (B, Hq, Lq, Lk) and the admissible set as a
    boolean; ``cap(z) = softcap * tanh(z / softcap)``, the identity for ``softcap = 0``; ``phi`` is
    ``score``'s with ``params`` (numbers or tensors broadcastable to ``(Hq,)``)."""
    hq, hk = query.shape[-3], key.shape[-3]
    if enable_gqa and hq != hk:
        key = key.repeat_interleave(hq // hk, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    z = scale * (query @ key.transpose(-2, -1))
    softcap = _check_softcap(softcap)
    if softcap > 0.0:
        z = softcap * torch.tanh(z / softcap)
    logits = score.phi(z, *(_per_head(p, hq, z) for p in params))
    lq, lk = z.shape[-2], z.shape[-1]
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=z.device)
    if is_causal:
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=z.device).tril()
    if tuple(window_size) != (-1, -1):
        allowed = allowed & window_band(lq, lk, window_size, z.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            logits = logits + attn_mask.to(logits.dtype)
    allowed = allowed & (logits != float("-inf"))  # NaN stays admissible, so it propagates
    logits = logits.masked_fill(~allowed, float("-inf"))
    return logits, allowed.expand_as(logits)


def _with_sink(logits: Tensor, allowed: Tensor, sinks) -> tuple:
    """``(logits, allowed)`` with one more column, the sink logit ``s_h`` of each row's head:
    ``(..., Hq, Lq, Lk + 1)``. A sink of -inf is inadmissible (the same rows as without it)."""
    hq = logits.shape[-3]
    # a Python number is taken in the logits' dtype (as_tensor alone would round it to float32)
    s = torch.as_tensor(sinks, dtype=None if isinstance(sinks, Tensor) else logits.dtype,
                        device=logits.device)
    if s.numel() not in (1, hq):
        raise ValueError(f"sinks must be a number or have one entry per query head ({hq}), "
                         f"got shape {tuple(s.shape)}")
    s = s.to(logits.dtype).reshape(-1).expand(hq).reshape(hq, 1, 1)
    col = s.expand(*logits.shape[:-1], 1)
    return torch.cat([logits, col], dim=-1), torch.cat([allowed, col != float("-inf")], dim=-1)


def _masked_softmax(logits: Tensor, allowed: Tensor) -> Tensor:
    """softmax over the last dim; rows with no admissible entry give 0 (and zero gradients)."""
    empty = ~allowed.any(dim=-1, keepdim=True)
    probs = torch.softmax(logits.masked_fill(empty, 0.0), dim=-1)
    return probs.masked_fill(empty, 0.0)


def _row_offset(logits: Tensor, allowed: Tensor) -> Tensor:
    """The row maximum of the admissible logits, 0 for an empty row, as a constant (detached):
    softmax is unchanged by it, and ``logits - offset`` is finite and small wherever ``logits``
    are finite, however negative (a finite mask at ``finfo.min``)."""
    if logits.shape[-1] == 0:  # no key at all: every row is empty
        return logits.new_zeros(logits.shape[:-1]).detach()
    m = logits.detach().masked_fill(~allowed, float("-inf")).amax(dim=-1)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _entropy(logits: Tensor, allowed: Tensor) -> Tensor:
    """Exact entropy ``-sum p log p`` (natural log) of softmax(logits) per row; 0 for empty rows.
    ``log p`` from the logits less their row maximum (:func:`_row_offset`): ``logits - lse``
    would lose ``log(sum)`` for rows at ``finfo.min``-sized logits."""
    p = _masked_softmax(logits, allowed)
    empty = ~allowed.any(dim=-1, keepdim=True)
    rel = (logits - _row_offset(logits, allowed).unsqueeze(-1)).masked_fill(~allowed, float("-inf"))
    logp = rel - torch.logsumexp(rel.masked_fill(empty, 0.0), dim=-1, keepdim=True)
    # where p underflows to 0 so does p log p, and its gradient p (log p + 1): without the fill
    # a finite mask of finfo.min would give log p = -3.4e38 and a gradient of 0 * inf
    return -(p * logp.masked_fill(~allowed | (p == 0), 0.0)).sum(-1)


def _adaptive_beta(logits, allowed, poly, threshold):
    """The paper's Fig. 4: ``beta = max(poly(H), 1)`` where ``H > threshold``, else 1."""
    h = _entropy(logits, allowed)
    beta = torch.where(h > threshold, torch.clamp(polyval(poly, h), min=1.0), torch.ones_like(h))
    return beta


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, score="softmax", score_params=None, adaptive_temperature=False,
              poly=DEFAULT_POLY, threshold=DEFAULT_THRESHOLD, return_lse=False, window_size=(-1, -1),
              dropout_mask=None, sinks=None, softcap=0.0):
    """The attention rows of the module docstring: ``out (B, Hq, Lq, Dv)`` (and, with
    ``return_lse``, the LSE ``(B, Hq, Lq)`` in float32, float64 for float64 inputs).

    SDPA's positional arguments; ``score`` a name in ``ssa_flash.scores.SCORES`` with its per-head
    parameters ``score_params`` (a mapping by name or a sequence in the registry's order; numbers or
    tensors broadcastable to ``(Hq,)``; None for softmax); ``adaptive_temperature`` with ``poly`` /
    ``threshold``; ``window_size = (left, right)`` (:func:`window_band`); ``sinks`` None, a number
    or ``(Hq,)``; ``softcap`` a float >= 0 (0: off). ``dropout_mask``: None (with ``dropout_p >
    0``: the kernels' Philox mask :func:`dropout_keep_mask` for a ``(seed, offset)`` drawn as the
    public functions draw it, ``ssa_flash.spec.draw_dropout_rng``) or a bool tensor broadcastable
    to ``(B, Hq, Lq, Lk)``, True = kept. Unbatched ``(H, L, D)`` inputs work too (B = 1)."""
    f, params = _score_of(score, score_params)
    logits, allowed = _logit_rows(query, key, attn_mask, is_causal, scale, enable_gqa, f, params,
                                  window_size, softcap)
    if sinks is not None:  # the sink is part of the row: of its entropy, temperature and LSE
        logits, allowed = _with_sink(logits, allowed, sinks)
    lse_offset = 0.0
    if adaptive_temperature:
        beta = _adaptive_beta(logits, allowed, poly, threshold).unsqueeze(-1)
        # softmax(beta * l) = softmax(beta * (l - c)) for the row maximum c (_row_offset): beta * l
        # alone can overflow where a finite mask is finfo.min. Zero the inadmissible entries before
        # scaling: d(beta * -inf)/d beta would be NaN
        c = _row_offset(logits, allowed).unsqueeze(-1)
        lse_offset = (beta * c).squeeze(-1).clamp(min=torch.finfo(c.dtype).min)  # finite, as the kernels
        logits = (beta * (logits - c).masked_fill(~allowed, 0.0)).masked_fill(~allowed, float("-inf"))
    probs = _masked_softmax(logits, allowed)
    if sinks is not None:
        probs = probs[..., :-1]  # the sink's value vector is zero: drop its weight
    if dropout_p > 0.0:
        if dropout_mask is None:
            seed, offset = draw_dropout_rng(query.device).tolist()
            shape4 = (1,) * (4 - probs.dim()) + tuple(probs.shape)  # unbatched inputs: B = 1
            dropout_mask = dropout_keep_mask(seed, offset, shape4, dropout_p, query.device).view(probs.shape)
        probs = _apply_dropout(probs, dropout_p, dropout_mask)
    hq, hk = query.shape[-3], value.shape[-3]
    if enable_gqa and hq != hk:
        value = value.repeat_interleave(hq // hk, dim=-3)
    out = probs @ value
    if not return_lse:
        return out
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return out, torch.logsumexp(logits.to(lse_dtype), dim=-1) + lse_offset


def attention_entropy(query, key, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *,
                      score="softmax", score_params=None, window_size=(-1, -1), sinks=None,
                      softcap=0.0) -> Tensor:
    """Per-row entropy (natural log) of the weights ``softmax(l)`` (no temperature), ``(B, Hq,
    Lq)``, arguments as in :func:`attention`; 0 for a row with no admissible key. With ``sinks``,
    the entropy of the whole row ``softmax([l, s_h])``, sink entry included (the entropy that
    drives the adaptive temperature)."""
    f, params = _score_of(score, score_params)
    logits, allowed = _logit_rows(query, key, attn_mask, is_causal, scale, enable_gqa, f, params,
                                  window_size, softcap)
    if sinks is not None:
        logits, allowed = _with_sink(logits, allowed, sinks)
    return _entropy(logits, allowed)


def _one_sequence(q, k, v, mask, is_causal, options):
    """``(out, lse)`` of ``(1, Hq, Lq, D)`` queries over ``(1, Hkv, Lk, D)`` keys (:func:`attention`
    with ``options``); no key: 0 and -inf (with sinks: the sink-only row, through the ordinary path)."""
    if k.shape[2] == 0 and options.get("sinks") is None:
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = q.new_zeros((*q.shape[:-1], v.shape[-1])) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()
        return out, torch.full(q.shape[:-1], float("-inf"), dtype=lse_dtype, device=q.device)
    return attention(q, k, v, mask, is_causal=is_causal, return_lse=True, **options)


def _lse_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *, return_lse=False,
                     dropout_mask=None, **options):
    """A packed variable-length batch: ``query (total_q, Hq, D)``, ``key (total_k, Hkv, D)``,
    ``value (total_k, Hkv, Dv)``; sequence ``s`` is query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``
    attending to key rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` by :func:`attention` (``options``:
    its keywords), every rule (causality and ``window_size`` top-left) inside the sequence. Returns
    ``out (total_q, Hq, Dv)`` and, with ``return_lse``, ``lse (Hq, total_q)``. Dropout: sequence ``s``
    is batch element ``s`` of the dense rule, its keep mask ``dropout_mask[s, :, :Lq_s, :Lk_s]`` of
    a ``(batch, Hq, max Lq_s, max Lk_s)`` bool mask (None with ``dropout_p > 0``: the kernels'
    Philox mask for a freshly drawn ``(seed, offset)``). A sequence with no key gives 0 (lse
    -inf), or with sinks puts its rows on the sink. ``max_seqlen_*`` (the public function's
    positional arguments) are not needed: the lengths are the ``cu_seqlens``'."""
    cq, ck = [int(x) for x in cu_seqlens_q.tolist()], [int(x) for x in cu_seqlens_k.tolist()]
    lq = [b - a for a, b in zip(cq, cq[1:])]
    lk = [b - a for a, b in zip(ck, ck[1:])]
    if dropout_p > 0.0 and dropout_mask is None:
        seed, offset = draw_dropout_rng(query.device).tolist()
        dropout_mask = dropout_keep_mask(seed, offset, (len(lq), query.shape[1], max(lq, default=0),
                                                        max(lk, default=0)), dropout_p, query.device)
    outs, lses = [], []
    for s in range(len(lq)):
        if lq[s] == 0:
            continue
        q_s, k_s, v_s = (x[c[s]:c[s + 1]].transpose(0, 1).unsqueeze(0)
                         for x, c in ((query, cq), (key, ck), (value, ck)))
        keep = dropout_mask[s:s + 1, :, :lq[s], :lk[s]] if dropout_p > 0.0 else None
        o, lse = _one_sequence(q_s, k_s, v_s, None, is_causal,
                               dict(options, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa,
                                    dropout_mask=keep))
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs) if outs else query.new_zeros((0, query.shape[1], value.shape[-1]))
    lse = torch.cat(lses, dim=1) if lses else torch.zeros((query.shape[1], 0), dtype=_lse_dtype(query),
                                                         device=query.device)
    return (out, lse) if return_lse else out


def attention_with_kvcache(query, k_cache, v_cache, cache_seqlens, key=None, value=None, *, is_causal=False,
                           window_size=(-1, -1), cache_leftpad=None, return_lse=False, **options):
    """Attention of ``query (B, Hq, Lq, D)`` over a KV cache ``(B, Hkv, Lcache, D)`` of which batch
    element ``b`` holds ``cache_seqlens[b]`` valid rows, by :func:`attention` (``options``: its
    keywords but dropout). New ``key``/``value`` ``(B, Hkv, Lnew, D)`` are first written into the
    caches in place at rows ``cache_seqlens[b]:cache_seqlens[b]+Lnew`` and attended too; with
    ``cache_leftpad`` (B,) the rows before ``cache_leftpad[b]`` are not attended. ``is_causal`` and
    ``window_size = (left, right)`` are bottom-right aligned: query ``i`` is at cache position
    ``pos_i = cache_len - Lq + i`` (``cache_len = cache_seqlens[b] + Lnew``) and sees rows ``j``
    with ``j <= pos_i`` (causal), ``pos_i - left <= j <= pos_i + right`` (-1: that side
    unbounded). Returns ``out (B, Hq, Lq, Dv)`` (and ``lse (B, Hq, Lq)``); a batch element with no
    row to attend gets 0 (lse -inf), or with sinks puts its rows on the sink (lse ``s_h``)."""
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
        mask = _bottom_right_band(Lq, end - start, is_causal, window_size, query.device)
        o, lse = _one_sequence(query[i:i + 1], k_cache[i:i + 1, :, start:end], v_cache[i:i + 1, :, start:end],
                               mask, False, options)
        outs.append(o)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) if return_lse else out
