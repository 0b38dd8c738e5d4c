"""SDPA's shapes for the dense functions: ``(N, ..., H, L, E)`` with any number of leading batch
dimensions (none: ``(H, L, E)``; 2-D ``(L, E)``: no head dimension either), batch and head
dimensions broadcast between query and key/value, as ``torch.nn.functional.
scaled_dot_product_attention`` takes them, brought to the kernels' ``(B, H, L, D)`` by views.

The inputs are padded with leading size-1 dimensions to a common rank (at least 3), the batch
dimensions (all but the last three) broadcast together into ``N...``, every tensor is expanded
to ``N...`` (zero strides, no copy) and its batch dimensions merged into one ``B = prod(N...)``
by ``reshape``, which is a view whenever the strides allow it: always for tensors whose batch
dimensions are not broadcast or are all broadcast; a tensor broadcast over some batch
dimensions and not others is copied (one stride cannot describe it). Heads follow SDPA too:
``Hq == Hkv``; ``enable_gqa`` (query head ``h`` uses key/value head ``h // (Hq // Hkv)``); else
one side with one head broadcast over the other's (one key/value head: grouped-query attention
with one group; one query head: a zero-stride view of it). Masks broadcast to the output's
``(N..., H, Lq, Lk)``; only their batch dimensions are merged (their own head and row dimensions
stay as given, expanded later as views). The output (and ``lse``) is viewed back to
``(N..., H, Lq, Dv)`` (``(Lq, Dv)`` for 2-D inputs).

This module imports only torch: ``ssa_flash.ops`` calls it (with the function to run on the
views) for inputs that are not already ``(B, H, L, D)`` with one batch size.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["to_bhld", "attention", "entropy"]


def _pad(x: Tensor, rank: int) -> Tensor:
    return x.view((1,) * (rank - x.dim()) + tuple(x.shape)) if x.dim() < rank else x


def _merge_batch(x: Tensor, batch: Tuple[int, ...], rows: Tuple[int, ...]) -> Tensor:
    """``x (..., *rows)`` expanded to ``(*batch, *rows)`` and its batch dims merged into one
    (a view where the strides allow it, else a copy)."""
    return x.expand(*batch, *rows).reshape(math.prod(batch), *rows)


def to_bhld(query: Tensor, key: Tensor, value: Optional[Tensor], attn_mask, enable_gqa: bool):
    """SDPA-shaped inputs as ``(B, H, L, D)`` views (see the module docstring).

    Returns ``(query, key, value, attn_mask, enable_gqa, unview)``: the 4-D tensors (``value``
    None if given None), the mask with its batch dims merged (None if None), the ``enable_gqa``
    to run them with, and ``unview(x)`` that views an output ``(B, H, Lq, ...)`` back to SDPA's
    shape (``(N..., H, Lq, ...)``; 2-D inputs: without the head dim)."""
    tensors = (query, key) if value is None else (query, key, value)
    names = ("query", "key", "value")
    for name, x in zip(names, tensors):
        if x.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims (L, E), got shape {tuple(x.shape)}")
    given_rank = max(x.dim() for x in tensors)
    rank = max(given_rank, 3)
    tensors = tuple(_pad(x, rank) for x in tensors)
    try:
        batch = tuple(torch.broadcast_shapes(*(x.shape[:-3] for x in tensors)))
    except RuntimeError:
        raise ValueError(f"the batch dims of {', '.join(names[:len(tensors)])} do not broadcast: "
                         f"{', '.join(str(tuple(x.shape[:-3])) for x in tensors)}") from None
    query, key = tensors[0], tensors[1]
    value = tensors[2] if len(tensors) == 3 else None
    hq, hkv = query.shape[-3], key.shape[-3]
    heads = hq
    if hq != hkv and not enable_gqa:
        if hkv == 1:  # one key/value head for every query head: GQA with one group
            enable_gqa = True
        elif hq == 1:  # one query head against every key/value head: a zero-stride view
            heads = hkv
            query = query.expand(*query.shape[:-3], hkv, *query.shape[-2:])
        else:
            raise ValueError(f"query has {hq} heads but key/value have {hkv}: pass enable_gqa=True for "
                             f"grouped-query attention")
    query = _merge_batch(query, batch, tuple(query.shape[-3:]))
    key = _merge_batch(key, batch, tuple(key.shape[-3:]))
    if value is not None:
        value = _merge_batch(value, batch, tuple(value.shape[-3:]))
    if isinstance(attn_mask, Tensor):
        if attn_mask.dim() > rank:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} has more dims than the output "
                             f"({rank})")
        mask = _pad(attn_mask, rank)
        try:
            if tuple(torch.broadcast_shapes(mask.shape[:-3], batch)) != batch:
                raise RuntimeError
        except RuntimeError:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the batch "
                             f"dims {batch}") from None
        attn_mask = _merge_batch(mask, batch, tuple(mask.shape[-3:]))
    drop_heads = given_rank == 2  # (L, E) inputs: no batch dims, and the one head is dropped

    def unview(x: Tensor) -> Tensor:
        x = x.view(*batch, *x.shape[1:])
        return x[0] if drop_heads else x

    return query, key, value, attn_mask, enable_gqa, unview


def attention(attend: Callable, query: Tensor, key: Tensor, value: Tensor, attn_mask, enable_gqa: bool,
              return_lse: bool, **options):
    """``attend(q, k, v, mask, enable_gqa=..., return_lse=True, **options) -> (out, lse)`` on the
    ``(B, H, L, D)`` views of SDPA-shaped inputs, the results viewed back."""
    query, key, value, attn_mask, enable_gqa, unview = to_bhld(query, key, value, attn_mask, enable_gqa)
    out, lse = attend(query, key, value, attn_mask, enable_gqa=enable_gqa, return_lse=True, **options)
    return (unview(out), unview(lse)) if return_lse else unview(out)


def entropy(row_entropy: Callable, query: Tensor, key: Tensor, attn_mask, enable_gqa: bool, **options) -> Tensor:
    """``row_entropy(q, k, mask, enable_gqa=..., **options) -> (B, H, Lq)`` on the views."""
    query, key, _, attn_mask, enable_gqa, unview = to_bhld(query, key, None, attn_mask, enable_gqa)
    return unview(row_entropy(query, key, attn_mask, enable_gqa=enable_gqa, **options))
