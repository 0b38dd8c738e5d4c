"""FlashAttention-2's calling convention over ssa_flash's functions: switching is an import line.

    # from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from ssa_flash.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    out = flash_attn_func(q, k, v, causal=True)                          # softmax, as FlashAttention
    out = flash_attn_func(q, k, v, causal=True, score="ssa", score_params={"b": 1.0, "n": 1.5})

The functions take FlashAttention-2's positional and keyword arguments with its semantics, on its
layouts (``(batch, seqlen, nheads, headdim)`` dense, ``(total, nheads, headdim)`` packed), and run
:func:`ssa_flash.attention`, :func:`ssa_flash.varlen_attention` and
:func:`ssa_flash.attention_with_kvcache` on transposed views. Every score function of
``ssa_flash.scores`` is reached through the keyword-only arguments ``score``, ``score_params``,
``adaptive_temperature`` (with ``poly``, ``threshold``), plus ``sinks`` and ``backend``; the
default is softmax, what FlashAttention computes.

FlashAttention's semantics that differ from SDPA's, and how they are kept:

* ``causal`` and ``window_size`` are aligned to the bottom-right corner: query ``i`` of ``Lq`` sits
  at key position ``i + Lk - Lq`` and sees keys ``[i + Lk - Lq - left, i + Lk - Lq + right]``
  (``causal``: ``right = 0``). ssa_flash's dense and packed functions align top-left (SDPA's
  rule); the two agree when ``Lq == Lk``. Otherwise :func:`flash_attn_func` slices the keys nobody
  sees off the front, or the queries that see nothing off the top (their output is 0), and passes
  the window that remains top-left: views, no copy except the zero rows;
  :func:`flash_attn_varlen_func` with different query and key offsets re-packs the queries so
  that each sequence's last query row is its last key row (see its docstring for the cost).
* A window side ``>= Lk`` (``>= max_seqlen_k`` for the packed form, the cache's length for the
  KV cache) is unbounded and a side given alone bounds the other at ``Lk``, as FlashAttention-2's
  kernels normalise the window (the latter matters only for ``Lq > Lk``).
* Grouped-query attention is implicit: ``nheads`` a multiple of ``nheads_k``.
* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: the log-sum-exp is
  FlashAttention's (``(batch, nheads, seqlen_q)`` dense, ``(nheads, total_q)`` packed, float32 or
  float64), but the probabilities are never materialised (``None``). A row with no key gets
  output 0 and ``lse = -inf`` (FlashAttention-2's forward writes ``+inf`` there).
* ``out`` is contiguous, like FlashAttention's (a copy of the output: the kernels write
  ``(batch, nheads, seqlen, headdim)``).

Not taken (each raises ``NotImplementedError`` naming the argument when given): ``alibi_slopes``,
``block_table`` (paged KV cache), ``rotary_cos`` / ``rotary_sin``, ``cache_batch_idx``.
"""
from __future__ import annotations

import numbers
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import ops
from .conventions import NO_WINDOW
from .temperature import DEFAULT_POLY, DEFAULT_THRESHOLD

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def _refuse(**given) -> None:
    """NotImplementedError for the first FlashAttention argument given that ssa_flash lacks."""
    for name, value in given.items():
        if value is not None:
            raise NotImplementedError(f"{name} is not supported by ssa_flash.flash_attn (pass None)")


def _check_layout(names: Sequence[str], tensors: Sequence[Tensor], dims: int, layout: str) -> None:
    for name, x in zip(names, tensors):
        ops._check_tensor(name, x)
        if x.dim() != dims:
            raise ValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}")


def _fa_window(window_size, causal, seqlen_k: int) -> Tuple[int, int]:
    """FlashAttention-2's window after its kernels' normalisation: a side ``>= seqlen_k`` is
    unbounded (``NO_WINDOW``), ``causal`` makes the right side 0, and one bounded side bounds the other at
    ``seqlen_k`` (which matters only for ``seqlen_q > seqlen_k``)."""
    left, right = ops._check_window(window_size)
    if left >= seqlen_k:
        left = NO_WINDOW
    if right >= seqlen_k:
        right = NO_WINDOW
    if ops._check_bool("causal", causal):
        right = 0
    if left < 0 and right >= 0:
        left = seqlen_k
    elif left >= 0 and right < 0:
        right = seqlen_k
    return left, right


def _top_left(left: int, right: int, lq: int, lk: int) -> Tuple[int, int, int, int]:
    """The bottom-right window ``(left, right)`` of an ``lq x lk`` score matrix, as
    ``(rows, keys, left', right')``: drop the first ``rows`` queries (they see no key), drop the
    first ``keys`` keys (no query sees them), and the rest is the top-left window ``(left',
    right')`` (``NO_WINDOW``: unbounded). Query ``i`` is at key position ``i + d``, ``d = lk - lq``; after
    the drops at ``i' + e`` with ``e = d + rows - keys``, and ``[i + d - left, i + d + right]``
    becomes ``[i' - (left - e), i' + (right + e)]``; the drops are what makes both sides >= 0."""
    d = lk - lq
    rows = min(max(-(d + right), 0), lq) if right >= 0 else 0
    keys = min(max(d - left, 0), lk) if left >= 0 else 0
    e = d + rows - keys
    return rows, keys, (left - e if left >= 0 else NO_WINDOW), (right + e if right >= 0 else NO_WINDOW)


def _variant(score, score_params, adaptive_temperature, poly, threshold, sinks, backend) -> dict:
    """The keyword arguments that choose the score function, passed through as they are."""
    return dict(score=score, score_params=score_params, adaptive_temperature=adaptive_temperature,
                poly=poly, threshold=threshold, sinks=sinks, backend=backend)


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, score="softmax", score_params=None,
                    adaptive_temperature: bool = False, poly: Sequence[float] = DEFAULT_POLY,
                    threshold: float = DEFAULT_THRESHOLD, sinks=None, backend: str = "auto"):
    """FlashAttention-2's ``flash_attn_func`` through :func:`ssa_flash.attention`.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``; k: ``(batch, seqlen_k, nheads_k, headdim)``;
            v: ``(batch, seqlen_k, nheads_k, headdim_v)``; ``nheads`` a multiple of ``nheads_k``.
        dropout_p, softmax_scale (default ``1/sqrt(headdim)``), softcap, deterministic: as
            ``dropout_p``, ``scale``, ``softcap``, ``deterministic`` of :func:`ssa_flash.attention`.
        causal, window_size: bottom-right aligned (module docstring).
        alibi_slopes: not supported (``NotImplementedError`` unless None).
        return_attn_probs: return ``(out, softmax_lse, None)`` instead of ``out``.
        score, score_params, adaptive_temperature, poly, threshold, sinks, backend: keyword
            only, as in :func:`ssa_flash.attention` (default: softmax).

    Returns:
        ``out (batch, seqlen_q, nheads, headdim_v)`` contiguous, or ``(out, softmax_lse, None)``
        with ``softmax_lse (batch, nheads, seqlen_q)``.
    """
    _refuse(alibi_slopes=alibi_slopes)
    _check_layout(("q", "k", "v"), (q, k, v), 4, "(batch, seqlen, nheads, headdim)")
    lq, lk = q.shape[1], k.shape[1]
    left, right = _fa_window(window_size, causal, lk)
    rows, keys, left, right = _top_left(left, right, lq, lk)
    # (B, L, H, D) -> (B, H, L, D): views, minus the rows that see nothing and the keys nobody sees
    qt, kt, vt = q[:, rows:].transpose(1, 2), k[:, keys:].transpose(1, 2), v[:, keys:].transpose(1, 2)
    out, lse = ops.attention(
        qt, kt, vt, None, dropout_p, right == 0, softmax_scale, True, window_size=(left, NO_WINDOW if right == 0 else right),
        return_lse=True, deterministic=deterministic, softcap=softcap,
        **_variant(score, score_params, adaptive_temperature, poly, threshold, sinks, backend))
    if rows:  # queries before the first key they may see: output 0, lse -inf (no key)
        out = torch.cat([out.new_zeros(*out.shape[:2], rows, out.shape[3]), out], dim=2)
        lse = torch.cat([lse.new_full((*lse.shape[:2], rows), float("-inf")), lse], dim=2)
    out = out.transpose(1, 2).contiguous()
    return (out, lse, None) if ops._check_bool("return_attn_probs", return_attn_probs) else out


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                             return_attn_probs: bool = False, **variant):
    """:func:`flash_attn_func` with ``kv (batch, seqlen_k, 2, nheads_k, headdim)`` (views of it)."""
    _check_layout(("kv",), (kv,), 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, **variant)


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                              return_attn_probs: bool = False, **variant):
    """:func:`flash_attn_func` with ``qkv (batch, seqlen, 3, nheads, headdim)`` (views of it)."""
    _check_layout(("qkv",), (qkv,), 5, "(batch, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, **variant)


def _bottom_right_packing(cu_q: Tensor, cu_k: Tensor, total_q: int, total_k: int):
    """Where each packed query row goes so that top-left alignment on the new packing is the
    bottom-right alignment of the old one: sequence ``s`` gets ``Lk_s`` query rows (as many as its
    keys), its query ``t`` at row ``t + Lk_s - Lq_s`` of them, zero rows before; a query whose row
    would be negative (``Lq_s > Lk_s``) goes to one extra sequence of one row and no key (output
    0, lse -inf). Computed on the device, without reading the offsets on the host.

    Returns ``(index (total_q,) int64, cu_new_q, cu_new_k)``: query row ``r`` is row
    ``index[r]`` of the new packing of ``total_k + 1`` rows."""
    rows = torch.arange(total_q, device=cu_q.device)
    seq = torch.searchsorted(cu_q[1:].to(torch.int64), rows, right=True)
    end_q, end_k, start_k = cu_q[1:].to(torch.int64)[seq], cu_k[1:].to(torch.int64)[seq], cu_k.to(torch.int64)[seq]
    target = end_k - (end_q - rows)
    index = torch.where(target >= start_k, target, torch.full_like(target, total_k))
    tail = cu_k.new_full((1,), total_k + 1)
    return index, torch.cat([cu_k, tail]), torch.cat([cu_k, tail - 1])


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[Tensor] = None, *,
                           score="softmax", score_params=None, adaptive_temperature: bool = False,
                           poly: Sequence[float] = DEFAULT_POLY, threshold: float = DEFAULT_THRESHOLD,
                           sinks=None, backend: str = "auto"):
    """FlashAttention-2's ``flash_attn_varlen_func`` through :func:`ssa_flash.varlen_attention`.

    ``q (total_q, nheads, headdim)``, ``k (total_k, nheads_k, headdim)``, ``v (total_k, nheads_k,
    headdim_v)``, ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 ``(batch + 1,)``, the other arguments
    as in :func:`flash_attn_func`; ``block_table`` (paged KV) is not supported.

    ``causal`` and ``window_size`` are bottom-right aligned in each sequence. Where that differs
    from the top-left alignment of :func:`ssa_flash.varlen_attention`, i.e. with a window or
    ``causal`` and offsets that are not one tensor (nor equal CPU tensors), the query rows are
    re-packed on the device (no host read) so that sequence ``s`` has ``Lk_s`` query rows, its real
    queries last: that costs a copy of ``q`` and of the output, and the kernels compute the
    padding rows too (``sum Lk_s`` rows instead of ``sum Lq_s``). Queries of a sequence with
    ``Lq_s > Lk_s`` before its first visible key get output 0; that is exact for ``causal``
    (right side 0) but not for a window whose right side is not 0, where such a layout raises
    ``NotImplementedError`` (found by reading the offsets: on a GPU that call synchronises).

    Returns ``out (total_q, nheads, headdim_v)``, or ``(out, softmax_lse (nheads, total_q), None)``.
    """
    _refuse(alibi_slopes=alibi_slopes, block_table=block_table)
    _check_layout(("q", "k", "v"), (q, k, v), 3, "(total, nheads, headdim)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        ops._check_index_tensor(name, cu, None, q.device)
    max_seqlen_k = ops._check_int("max_seqlen_k", max_seqlen_k, minimum=1)
    left, right = _fa_window(window_size, causal, max_seqlen_k)
    kw = dict(scale=softmax_scale, enable_gqa=True, return_lse=True, deterministic=deterministic, softcap=softcap,
              **_variant(score, score_params, adaptive_temperature, poly, threshold, sinks, backend))
    same = (left, right) == (-1, -1) or cu_seqlens_q is cu_seqlens_k or (
        ops._host_checkable(cu_seqlens_q, cu_seqlens_k) and torch.equal(cu_seqlens_q, cu_seqlens_k))
    if same:  # top-left is bottom-right: every sequence has as many queries as keys, or no window
        out, lse = ops.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                        right == 0, window_size=(left, NO_WINDOW if right == 0 else right), **kw)
    else:
        if right != 0:
            lq, lk = cu_seqlens_q.diff(), cu_seqlens_k.diff()
            if lq.shape == lk.shape and bool((lq > lk).any()):
                raise NotImplementedError(
                    f"flash_attn_varlen_func: window_size {tuple(window_size)} (right side not 0) with a sequence "
                    f"that has more queries than keys is not supported")
        index, cu_new_q, cu_new_k = _bottom_right_packing(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
        packed = q.new_zeros(k.shape[0] + 1, *q.shape[1:]).index_put((index,), q)
        out, lse = ops.varlen_attention(packed, k, v, cu_new_q, cu_new_k, max_seqlen_k, max_seqlen_k, dropout_p,
                                        right == 0, window_size=(left, NO_WINDOW if right == 0 else right), **kw)
        out, lse = out.index_select(0, index), lse.index_select(1, index)
    return (out, lse, None) if ops._check_bool("return_attn_probs", return_attn_probs) else out


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                    return_attn_probs: bool = False, **variant):
    """:func:`flash_attn_varlen_func` with ``kv (total_k, 2, nheads_k, headdim)`` (views of it)."""
    _check_layout(("kv",), (kv,), 4, "(total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, **variant)


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                     return_attn_probs: bool = False, **variant):
    """:func:`flash_attn_varlen_func` with ``qkv (total, 3, nheads, headdim)`` and one
    ``cu_seqlens`` (views of ``qkv``)."""
    _check_layout(("qkv",), (qkv,), 4, "(total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  **variant)


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None,
                            cache_seqlens: Optional[Union[int, Tensor]] = None,
                            cache_batch_idx: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[Tensor] = None,
                            num_splits: int = 0, return_softmax_lse: bool = False, *, score="softmax",
                            score_params=None, adaptive_temperature: bool = False,
                            poly: Sequence[float] = DEFAULT_POLY, threshold: float = DEFAULT_THRESHOLD,
                            sinks=None, backend: str = "auto"):
    """FlashAttention-2's ``flash_attn_with_kvcache`` through :func:`ssa_flash.attention_with_kvcache`
    (forward only, like FlashAttention's).

    ``q (batch, seqlen_q, nheads, headdim)``; caches ``(batch, seqlen_cache, nheads_k, headdim)``,
    written in place at rows ``cache_seqlens[b]:`` when ``k``, ``v`` ``(batch, seqlen_new,
    nheads_k, headdim)`` are given. ``cache_seqlens``: an int or an int32 ``(batch,)`` tensor; None
    means every cache row is valid (then ``k``, ``v`` cannot be given). ``causal`` and
    ``window_size`` are bottom-right (query ``i`` at position ``cache_seqlens[b] + seqlen_new -
    seqlen_q + i``), ``cache_leftpad``, ``num_splits``, ``softcap`` as in
    :func:`ssa_flash.attention_with_kvcache`. Not supported: ``rotary_cos`` / ``rotary_sin``,
    ``cache_batch_idx``, ``block_table``, ``alibi_slopes`` (``rotary_interleaved`` is then unused).

    Returns ``out (batch, seqlen_q, nheads, headdim_v)``, or ``(out, softmax_lse)`` with
    ``return_softmax_lse`` (``softmax_lse (batch, nheads, seqlen_q)``).
    """
    _refuse(rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
            block_table=block_table, alibi_slopes=alibi_slopes)
    _check_layout(("q", "k_cache", "v_cache"), (q, k_cache, v_cache), 4, "(batch, seqlen, nheads, headdim)")
    for name, x in (("k", k), ("v", v)):
        if x is not None:
            _check_layout((name,), (x,), 4, "(batch, seqlen_new, nheads_k, headdim)")
    batch, cache_len = q.shape[0], k_cache.shape[1]
    if cache_seqlens is None:
        if k is not None or v is not None:
            raise ValueError("cache_seqlens must be given with k and v (the rows where they are written)")
        cache_seqlens = cache_len
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    left, right = _fa_window(window_size, causal, cache_len)
    out, lse = ops.attention_with_kvcache(
        q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), cache_seqlens,
        None if k is None else k.transpose(1, 2), None if v is None else v.transpose(1, 2),
        is_causal=right == 0, scale=softmax_scale, enable_gqa=True, window_size=(left, NO_WINDOW if right == 0 else right),
        return_lse=True, cache_leftpad=cache_leftpad, num_splits=num_splits, softcap=softcap,
        **_variant(score, score_params, adaptive_temperature, poly, threshold, sinks, backend))
    out = out.transpose(1, 2).contiguous()
    return (out, lse) if ops._check_bool("return_softmax_lse", return_softmax_lse) else out
