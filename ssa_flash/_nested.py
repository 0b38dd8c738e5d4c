"""Jagged nested tensors for the dense functions: ``(B, H, j, D)`` ``torch.nested`` tensors
(``layout=torch.jagged``, ragged sequence dimension), as ``scaled_dot_product_attention`` takes
them and transformers / torchtune users build them: ``torch.nested.nested_tensor(seqs,
layout=torch.jagged)`` of ``(L_s, H, D)`` sequences, ``.transpose(1, 2)``.

They run as packed variable-length batches (``ssa_flash.varlen_attention``: no padding, every
variant, forward and backward): the packed rows are a view of the nested tensor's buffer
(``values()``, ``(H, total, D)`` for ``(B, H, j, D)``, transposed to ``(total, H, D)``), the
sequence offsets its ``offsets()`` (as int32, a copy of ``B + 1`` integers) and the longest
sequence its ``_max_seqlen`` (cached by the nested tensor; computed from the offsets otherwise,
a host read). The output is a nested tensor on the query's offsets, ``(B, Hq, j, Dv)`` with the
query's ragged dimension, and ``lse`` one of shape ``(B, Hq, j)``; gradients flow back to the
nested inputs through ``values()``.

Semantics are those of the packed functions: ``is_causal`` and ``window_size`` top-left in each
sequence (SDPA itself refuses ``is_causal`` with nested tensors); no ``attn_mask`` (as SDPA's
nested path). Keys and values are nested on their own offsets (cross attention: ``Lk_s`` may
differ from ``Lq_s``; the batch sizes must agree).

This module imports only torch: ``ssa_flash.ops`` calls it, with ``varlen_attention``.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["attention"]


def _check(name: str, x) -> None:
    if not (isinstance(x, Tensor) and x.is_nested):
        raise TypeError(f"{name} must be a nested tensor like query (all three nested or none)")
    if x.layout != torch.jagged:
        raise TypeError(f"{name} must be a nested tensor of layout torch.jagged, got {x.layout}")
    if x.dim() != 4 or x._ragged_idx != 2:
        raise ValueError(f"{name} must be a jagged nested tensor (B, H, j, D) with the ragged sequence dim third "
                         f"(nested (B, j, H, D) sequences transposed by .transpose(1, 2)), got shape {tuple(x.shape)}")


def _packed(x: Tensor) -> Tensor:
    """``(total, H, D)``: a view of the nested ``(B, H, j, D)`` tensor's rows."""
    return x.values().transpose(0, 1)


def _unpack(rows: Tensor, like: Tensor) -> Tensor:
    """Packed ``(total, H, ...)`` rows as a nested ``(B, H, j, ...)`` tensor on ``like``'s offsets."""
    nested = torch.nested.nested_tensor_from_jagged(rows, offsets=like.offsets(), max_seqlen=like._max_seqlen,
                                                    min_seqlen=like._min_seqlen)
    return nested.transpose(1, 2)


def attention(varlen: Callable, query: Tensor, key: Tensor, value: Tensor, attn_mask, enable_gqa: bool,
              return_lse: bool, *, dropout_p, is_causal, scale, score, score_params, adaptive, poly, threshold,
              backend, deterministic, window_size, sinks, softcap):
    """``varlen(...)`` (``ssa_flash.varlen_attention``) on nested ``(B, H, j, D)`` query, key and
    value; returns the nested output (and lse) as the module docstring says."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check(name, x)
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported with nested tensors (as in scaled_dot_product_attention): "
                         "their sequences are unpadded already")
    q_offsets, k_offsets = query.offsets(), key.offsets()
    if k_offsets.shape != q_offsets.shape:
        raise ValueError(f"query and key must have the same batch size, got {q_offsets.shape[0] - 1} and "
                         f"{k_offsets.shape[0] - 1}")
    q, k, v = _packed(query), _packed(key), _packed(value)
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"key and value must have the same sequences, got {k.shape[0]} and {v.shape[0]} rows")
    cu_q = q_offsets.to(torch.int32)
    cu_k = cu_q if k_offsets is q_offsets else k_offsets.to(torch.int32)
    out, lse = varlen(q, k, v, cu_q, cu_k, max(query._max_seqlen, 1), max(key._max_seqlen, 1), dropout_p, is_causal,
                      scale, enable_gqa, score=score, score_params=score_params, adaptive_temperature=adaptive,
                      poly=poly, threshold=threshold, window_size=window_size, return_lse=True, backend=backend,
                      deterministic=deterministic, sinks=sinks, softcap=softcap)
    out = _unpack(out, query)
    return (out, _unpack(lse.transpose(0, 1), query)) if return_lse else out
