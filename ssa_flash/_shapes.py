"""SDPA's shapes for the dense functions: ``(N, ..., H, L, E)`` with any number of leading batch
dimensions (none: ``(H, L, E)``; 2-D ``(L, E)``: no head dimension either), batch and head
dimensions broadcast between query and key/value, as ``torch.nn.functional.
scaled_dot_product_attention`` takes them, brought to the kernels' ``(B, H, L, D)`` by views.

The inputs are padded with leading size-1 dimensions to a common rank (at least 3), the batch
dimensions (all but the last three) broadcast together into ``N...``, every tensor is expanded
to ``N...`` (zero strides, no copy) and its batch dimensions merged into one ``B = prod(N...)``:
a view for tensors whose batch dimensions are not broadcast or are all broadcast. A tensor
broadcast over some batch dimensions and not others cannot be one strided batch dimension
(``(1, N2)`` keys against ``(N1, N2)`` queries); there the trailing batch dimensions are merged
into the heads instead (``B = N1`` with the keys' zero stride, ``N2 * H`` heads, per-head
parameters tiled to match), when that split gives views of every tensor; when none does, the
tensors that need it are copied (``reshape``). Heads follow SDPA too:
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


def _split_view(x: Tensor, batch: Tuple[int, ...], split: int) -> Optional[Tensor]:
    """``x (..., H, L, D)`` expanded to ``(*batch, H, L, D)`` as the view ``(prod(batch[:split]),
    prod(batch[split:]) * H, L, D)``: the batch dims after ``split`` merged into the heads, head
    index ``r * H + h``. None where the strides allow no such view."""
    rows = tuple(x.shape[-3:])
    x = x.expand(*batch, *rows)
    if x.numel() and not (_mergeable(x, 0, split) and _mergeable(x, split, len(batch) + 1)):
        return None
    return x.view(math.prod(batch[:split]), math.prod(batch[split:]) * rows[0], *rows[1:])


def _mergeable(x: Tensor, start: int, stop: int) -> bool:
    """Whether dims ``[start, stop)`` of ``x`` merge into one strided dim (a view): each stride
    is the next one times the next size, size-1 dims aside. (Read off the strides rather than
    tried with ``view``, so that torch.compile traces it.)"""
    dims = [(x.shape[i], x.stride(i)) for i in range(start, stop) if x.shape[i] != 1]
    return all(stride == next_stride * next_size for (_, stride), (next_size, next_stride) in zip(dims, dims[1:]))


def _views(tensors, batch: Tuple[int, ...]):
    """The 4-D views of ``tensors`` and how many times the heads repeat: batch dims merged into
    ``B`` where the strides allow it; else the trailing batch dims that no tensor broadcasts
    merged into the heads (``(1, N2)`` keys against ``(N1, N2)`` queries: ``B = N1`` with the keys'
    zero stride, ``N2 * H`` heads); else (no split gives views) a copy (``reshape``)."""
    for split in range(len(batch), -1, -1):
        views = [_split_view(x, batch, split) for x in tensors]
        if all(v is not None for v in views):
            return views, math.prod(batch[split:])
    return [_merge_batch(x, batch, tuple(x.shape[-3:])) for x in tensors], 1


def _tile(x, heads: int, repeat: int):
    """A per-head parameter ``(heads,)`` for heads repeated ``repeat`` times (index ``r * heads + h``);
    numbers, ``()`` tensors and anything else pass unchanged (and are checked by the caller)."""
    if repeat == 1 or not isinstance(x, Tensor) or x.dim() != 1 or x.shape[0] != heads:
        return x
    return x.repeat(repeat)


def tile_params(options: dict, names: Tuple[str, ...], heads: int, repeat: int) -> dict:
    """``options`` with the per-head parameters among ``names`` (``score_params``, a dict or a
    sequence of them, or single ones: ``sinks``, ``b``, ``n``) tiled by :func:`_tile`."""
    if repeat == 1:
        return options
    options = dict(options)
    for name in names:
        x = options.get(name)
        if isinstance(x, dict):
            options[name] = {k: _tile(v, heads, repeat) for k, v in x.items()}
        elif isinstance(x, (tuple, list)):
            options[name] = type(x)(_tile(v, heads, repeat) for v in x)
        else:
            options[name] = _tile(x, heads, repeat)
    return options


def to_bhld(query: Tensor, key: Tensor, value: Optional[Tensor], attn_mask, enable_gqa: bool):
    """SDPA-shaped inputs as ``(B, H, L, D)`` views (see the module docstring).

    Returns ``(query, key, value, attn_mask, enable_gqa, heads, repeat, unview)``: the 4-D
    tensors (``value`` None if given None), the mask likewise (None if None), the ``enable_gqa``
    to run them with, the output's heads ``H`` and how many times the 4-D views repeat them
    (``repeat > 1``: batch dims merged into the heads, per-head parameters to be tiled by
    :func:`tile_params`), and ``unview(x)`` that views an output ``(B, repeat * H, Lq, ...)`` back to
    SDPA's shape (``(N..., H, Lq, ...)``; 2-D inputs: without the head dim)."""
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
    views, repeat = _views((query, key) if value is None else (query, key, value), batch)
    query, key, value = views[0], views[1], (views[2] if value is not None else None)
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
        if repeat == 1:  # only the batch dims merged; heads and rows expand later, as views
            attn_mask = _merge_batch(mask, batch, tuple(mask.shape[-3:]))
        else:  # some batch dims go into the heads: the mask's heads are expanded to the output's first
            if mask.shape[-3] not in (1, heads):
                raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {heads} heads")
            mask = mask.expand(*mask.shape[:-3], heads, *mask.shape[-2:])
            attn_mask = mask.expand(*batch, *mask.shape[-3:]).reshape(query.shape[0], query.shape[1],
                                                                      *mask.shape[-2:])
    drop_heads = given_rank == 2  # (L, E) inputs: no batch dims, and the one head is dropped

    def unview(x: Tensor) -> Tensor:
        x = x.view(*batch, heads, *x.shape[2:])
        return x[0] if drop_heads else x

    return query, key, value, attn_mask, enable_gqa, heads, repeat, unview


def attention(attend: Callable, query: Tensor, key: Tensor, value: Tensor, attn_mask, enable_gqa: bool,
              return_lse: bool, **options):
    """``attend(q, k, v, mask, enable_gqa=..., return_lse=True, **options) -> (out, lse)`` on the
    ``(B, H, L, D)`` views of SDPA-shaped inputs, the results viewed back."""
    query, key, value, attn_mask, enable_gqa, heads, repeat, unview = to_bhld(query, key, value, attn_mask, enable_gqa)
    options = tile_params(options, ("score_params", "sinks"), heads, repeat)
    out, lse = attend(query, key, value, attn_mask, enable_gqa=enable_gqa, return_lse=True, **options)
    return (unview(out), unview(lse)) if return_lse else unview(out)


def entropy(row_entropy: Callable, query: Tensor, key: Tensor, attn_mask, enable_gqa: bool, **options) -> Tensor:
    """``row_entropy(q, k, mask, enable_gqa=..., **options) -> (B, H, Lq)`` on the views."""
    query, key, _, attn_mask, enable_gqa, heads, repeat, unview = to_bhld(query, key, None, attn_mask, enable_gqa)
    options = tile_params(options, ("score_params", "sinks"), heads, repeat)
    return unview(row_entropy(query, key, attn_mask, enable_gqa=enable_gqa, **options))
