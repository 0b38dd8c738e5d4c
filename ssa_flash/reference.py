"""The specification in code: naive attention with every score materialised.

Shapes follow ``torch.nn.functional.scaled_dot_product_attention``: ``query (B, Hq, Lq, D)``,
``key (B, Hkv, Lk, D)``, ``value (B, Hkv, Lk, Dv)``; the output is ``(B, Hq, Lq, Dv)``.
Everything is computed in the inputs' dtype (so this is also "the naive implementation in low
precision" that FlashAttention's error rule compares against); call it on float64 copies for a
gold standard. Memory is O(Lq * Lk): use it for testing, not for training.

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
from typing import Optional, Union

import torch
from torch import Tensor

from . import scores
from .scores import ssa_logits
from .conventions import DEFAULT_POLY, DEFAULT_THRESHOLD, dropout_keep_threshold
from .temperature import polyval

__all__ = [
    "dropout_keep_mask",
    "draw_dropout_rng",
    "attention",
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


def draw_dropout_rng(device) -> Tensor:
    """The ``(seed, offset)`` pair (int64 tensor ``(2,)`` on ``device``) of one dropout call, drawn
    from torch's default generator for ``device``, so ``torch.manual_seed`` before a call decides
    its mask. Drawn on the device (no host synchronisation; inside a CUDA graph each replay draws
    anew)."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


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


def window_band(lq: int, lk: int, window_size, device=None) -> Tensor:
    """``(Lq, Lk)`` bool: ``i - left <= j <= i + right`` for ``window_size = (left, right)``, a
    side of -1 being unbounded (top-left aligned, like ``is_causal``)."""
    left, right = window_size
    i = torch.arange(lq, device=device).view(lq, 1)
    j = torch.arange(lk, device=device).view(1, lk)
    band = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if left >= 0:
        band = band & (j >= i - left)
    if right >= 0:
        band = band & (j <= i + right)
    return band


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


def _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
            score=scores.SOFTMAX, params=(), adaptive=False, poly=DEFAULT_POLY, threshold=DEFAULT_THRESHOLD,
            window_size=(-1, -1), dropout_mask=None, sinks=None, softcap=0.0):
    logits, allowed = _logit_rows(query, key, attn_mask, is_causal, scale, enable_gqa, score, params,
                                  window_size, softcap)
    if sinks is not None:  # the sink is part of the row: of its entropy, temperature and LSE
        logits, allowed = _with_sink(logits, allowed, sinks)
    lse_offset = 0.0
    if adaptive:
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


# Every function below takes SDPA's arguments plus ``window_size=(left, right)`` (see
# ``window_band``) and ``dropout_mask``: None (with ``dropout_p > 0``: the kernels' Philox mask for a
# (seed, offset) drawn by ``draw_dropout_rng``, as the kernels do) or a bool tensor broadcastable to
# ``(B, Hq, Lq, Lk)``, True = kept. And two keywords (docs/maths.md, "Attention sinks and
# soft-capping"):
#
# * ``softcap=c`` (float, 0 = off; negative: ValueError): the scaled score ``z`` becomes
#   ``c * tanh(z / c)`` before the logit transform; masks are added after.
# * ``sinks=s`` (None, a number or a ``(Hq,)`` tensor, may require grad): head ``h``'s rows get one
#   more logit ``s_h`` with a zero value vector. The weights of a row then sum to ``1 - P_sink``;
#   a row with no admissible key puts all its weight on the sink: output 0, LSE ``s_h`` (its
#   one-entry row has entropy 0, so the adaptive temperature is ``beta(0)`` = 1 there for the
#   default polynomial), finite gradients. ``s = -inf`` is the same as no sink.


# The functions below take (and ignore) the public functions' other keywords (backend=,
# deterministic=, ...) so that a test can call the spec with the public call's keywords; but a
# keyword that selects the score function and is not theirs is refused: a stray ``ssa=`` / ``b=``
# / ``n=`` (the packed and cache functions' old spelling) must not quietly compute softmax.
_SCORE_KEYWORDS = frozenset({"ssa", "b", "n", "score", "score_params", "adaptive_temperature"})


def _run_options_only(fn: str, options) -> None:
    stray = sorted(_SCORE_KEYWORDS.intersection(options))
    if stray:
        raise TypeError(f"reference.{fn}() got unexpected keyword argument(s) {', '.join(stray)} "
                        "(the score function: score= / score_params=, or the named functions)")


def softmax_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                      scale=None, enable_gqa=False, *, return_lse=False, window_size=(-1, -1),
                      dropout_mask=None, sinks=None, softcap=0.0, **_ignored):
    """Plain softmax attention (what SDPA computes), except that empty rows give 0, not NaN."""
    _run_options_only("softmax_attention", _ignored)
    return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                   window_size=window_size, dropout_mask=dropout_mask, sinks=sinks, softcap=softcap)


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, score="softmax", score_params=None, adaptive_temperature=False,
              poly=DEFAULT_POLY, threshold=DEFAULT_THRESHOLD, return_lse=False, window_size=(-1, -1),
              dropout_mask=None, sinks=None, softcap=0.0, **_ignored):
    """Attention with the score function ``score`` (a name in ``ssa_flash.scores.SCORES``) and its
    per-head parameters ``score_params`` (a mapping by name, or a sequence in the registry's order;
    numbers or tensors broadcastable to ``(Hq,)``)."""
    _run_options_only("attention", _ignored)
    f, params = _score_of(score, score_params)
    return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                   return_lse, score=f, params=params, adaptive=adaptive_temperature, poly=poly,
                   threshold=threshold, window_size=window_size, dropout_mask=dropout_mask,
                   sinks=sinks, softcap=softcap)


def ssa_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, *, b: Scalar = 1.0, n: Scalar = 1.5,
                  adaptive_temperature=False, poly=DEFAULT_POLY, threshold=DEFAULT_THRESHOLD,
                  return_lse=False, window_size=(-1, -1), dropout_mask=None, sinks=None,
                  softcap=0.0, **_ignored):
    """SSA attention: weights ``(1 + b|z|)^(sgn(z) n)`` normalised over keys; ``b``, ``n`` per head."""
    _run_options_only("ssa_attention", _ignored)
    return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                   return_lse, score=scores.SSA, params=(b, n), adaptive=adaptive_temperature, poly=poly,
                   threshold=threshold, window_size=window_size, dropout_mask=dropout_mask,
                   sinks=sinks, softcap=softcap)


def adaptive_temperature_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                   is_causal=False, scale=None, enable_gqa=False, *,
                                   poly=DEFAULT_POLY, threshold=DEFAULT_THRESHOLD,
                                   return_lse=False, window_size=(-1, -1), dropout_mask=None,
                                   sinks=None, softcap=0.0, **_ignored):
    """Softmax attention with the entropy-driven temperature of "Softmax is not Enough"."""
    _run_options_only("adaptive_temperature_attention", _ignored)
    return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                   return_lse, adaptive=True, poly=poly, threshold=threshold,
                   window_size=window_size, dropout_mask=dropout_mask, sinks=sinks, softcap=softcap)


def attention_entropy(query, key, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                      *, b: Optional[Scalar] = None, n: Optional[Scalar] = None,
                      window_size=(-1, -1), sinks=None, softcap=0.0, score=None,
                      score_params=None) -> Tensor:
    """Per-row entropy (natural log) of the attention weights, ``(B, Hq, Lq)``; SSA if b, n given,
    ``score`` / ``score_params`` as in :func:`attention` if given, else softmax.
    With ``sinks``, the entropy of the whole row ``softmax([l, s_h])``, sink entry included (the
    entropy that drives the adaptive temperature)."""
    if (b is None) != (n is None):
        raise ValueError("attention_entropy: give both b and n (SSA) or neither (softmax)")
    f, params = _score_of(*(("ssa", (b, n)) if b is not None else (score, score_params)))
    logits, allowed = _logit_rows(query, key, attn_mask, is_causal, scale, enable_gqa, f, params,
                                  window_size, softcap)
    if sinks is not None:
        logits, allowed = _with_sink(logits, allowed, sinks)
    return _entropy(logits, allowed)


def _one_sequence(q, k, v, mask, is_causal, scale, enable_gqa, score, params, adaptive, poly, threshold,
                  dropout_p=0.0, window_size=(-1, -1), dropout_mask=None, sinks=None, softcap=0.0):
    """``(out, lse)`` of ``(1, Hq, Lq, D)`` queries over ``(1, Hkv, Lk, D)`` keys; no key: 0, -inf
    (with sinks: 0 and the LSE of the sink-only row, through the ordinary path)."""
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if k.shape[2] == 0 and sinks is None:
        out = q.new_zeros((*q.shape[:-1], v.shape[-1])) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()
        return out, torch.full(q.shape[:-1], float("-inf"), dtype=lse_dtype, device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _attend(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, True,
                   score=score, params=params, adaptive=adaptive, poly=poly,
                   threshold=threshold, window_size=window_size, dropout_mask=dropout_mask,
                   sinks=sinks, softcap=softcap)


def varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *, score=None,
                     score_params=None, adaptive_temperature=False, poly=DEFAULT_POLY,
                     threshold=DEFAULT_THRESHOLD, window_size=(-1, -1), return_lse=False,
                     dropout_mask=None, sinks=None, softcap=0.0, **_ignored):
    """Packed variable-length batch: ``query (total_q, Hq, D)``, ``key (total_k, Hkv, D)``, ``value
    (total_k, Hkv, Dv)``; sequence ``s`` is query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` attending
    to key rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``, with every rule (causality top-left, as in
    ``ssa_attention``) applied inside the sequence. ``score`` / ``score_params``: as in
    :func:`attention` (None: softmax). Returns ``out
    (total_q, Hq, Dv)`` and, with ``return_lse``, ``lse (Hq, total_q)``. The ``max_seqlen_*`` are
    not needed here. Each sequence runs on its own (a loop), differentiably; ``window_size`` is
    top-left aligned inside each sequence. Dropout: sequence ``s`` is batch element ``s`` of the
    dense rule, i.e. its keep mask is ``dropout_mask[s, :, :Lq_s, :Lk_s]`` of a ``(batch, Hq,
    max_seqlen_q, max_seqlen_k)`` bool mask (None with ``dropout_p > 0``: the kernels' Philox mask
    for a freshly drawn ``(seed, offset)``). ``sinks``/``softcap``: per row, as in ``ssa_attention``
    (a sequence with no key puts its rows on the sink)."""
    _run_options_only("varlen_attention", _ignored)
    f, params = _score_of(score, score_params)
    cq, ck = [int(x) for x in cu_seqlens_q.tolist()], [int(x) for x in cu_seqlens_k.tolist()]
    if dropout_p > 0.0 and dropout_mask is None:
        seed, offset = draw_dropout_rng(query.device).tolist()
        dropout_mask = dropout_keep_mask(seed, offset, (len(cq) - 1, query.shape[1],
                                                        max((b - a for a, b in zip(cq, cq[1:])), default=0),
                                                        max((b - a for a, b in zip(ck, ck[1:])), default=0)),
                                         dropout_p, query.device)
    cq, ck = [int(x) for x in cu_seqlens_q.tolist()], [int(x) for x in cu_seqlens_k.tolist()]
    outs, lses = [], []
    for s in range(len(cq) - 1):
        if cq[s + 1] == cq[s]:
            continue
        q_s = query[cq[s]:cq[s + 1]].transpose(0, 1).unsqueeze(0)
        k_s = key[ck[s]:ck[s + 1]].transpose(0, 1).unsqueeze(0)
        v_s = value[ck[s]:ck[s + 1]].transpose(0, 1).unsqueeze(0)
        keep = None
        if dropout_p > 0.0:
            keep = dropout_mask[s:s + 1, :, :q_s.shape[2], :k_s.shape[2]]
        o, lse = _one_sequence(q_s, k_s, v_s, None, is_causal, scale, enable_gqa, f, params,
                               adaptive_temperature, poly, threshold, dropout_p, window_size, keep,
                               sinks, softcap)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = torch.cat(outs) if outs else query.new_zeros((0, query.shape[1], value.shape[-1]))
    lse = torch.cat(lses, dim=1) if lses else torch.zeros((query.shape[1], 0), dtype=lse_dtype, device=query.device)
    return (out, lse) if return_lse else out


def attention_with_kvcache(query, k_cache, v_cache, cache_seqlens, key=None, value=None, *,
                           is_causal=False, scale=None, enable_gqa=False, score=None, score_params=None,
                           adaptive_temperature=False, poly=DEFAULT_POLY,
                           threshold=DEFAULT_THRESHOLD, window_size=(-1, -1), return_lse=False,
                           cache_leftpad=None, sinks=None, softcap=0.0, **_ignored):
    """Attention of ``query (B, Hq, Lq, D)`` over a KV cache ``(B, Hkv, Lcache, D)`` of which batch
    element ``b`` holds ``cache_seqlens[b]`` valid rows. New ``key``/``value`` ``(B, Hkv, Lnew, D)``
    are first written into the caches in place at rows ``cache_seqlens[b]:cache_seqlens[b]+Lnew``
    and attended too. With ``cache_leftpad`` (B,) rows before ``cache_leftpad[b]`` are not attended.
    ``is_causal`` is bottom-right: query ``i`` is at cache position ``cache_len - Lq + i`` (``cache_len
    = cache_seqlens[b] + Lnew``) and sees the rows up to it. Returns ``out (B, Hq, Lq, Dv)`` (and
    ``lse (B, Hq, Lq)``); a batch element with no row to attend gets 0 (lse -inf).
    ``window_size = (left, right)`` is bottom-right aligned like ``is_causal``: query ``i`` sees
    rows ``j`` with ``pos_i - left <= j <= pos_i + right`` (-1: that side unbounded).
    ``sinks``/``softcap``: per row, as in ``ssa_attention`` (a batch element with no row to attend
    puts its rows on the sink: output 0, lse ``s_h``). ``score`` / ``score_params``: as in
    :func:`varlen_attention`."""
    _run_options_only("attention_with_kvcache", _ignored)
    f, params = _score_of(score, score_params)
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
        pos = torch.arange(Lq, device=query.device)[:, None] + (end - start - Lq)  # bottom-right
        j = torch.arange(end - start, device=query.device)[None, :]
        mask = torch.ones(Lq, end - start, dtype=torch.bool, device=query.device)
        if is_causal:
            mask = mask & (j <= pos)
        if window_size[0] >= 0:
            mask = mask & (j >= pos - window_size[0])
        if window_size[1] >= 0:
            mask = mask & (j <= pos + window_size[1])
        o, lse = _one_sequence(query[i:i + 1], k_s, v_s, mask, False, scale, enable_gqa, f, params,
                               adaptive_temperature, poly, threshold, sinks=sinks, softcap=softcap)
        outs.append(o)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) if return_lse else out
