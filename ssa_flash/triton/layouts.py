"""The layouts a call's tensors come in (dense, :class:`Packed` variable-length, :class:`KVCache`)
resolved into what the kernels index (:class:`_Layout`: lengths, strides, the ``VARLEN`` mode of
``extents.py``), the per-row statistics' shapes, and split-KV decoding's split count."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .block_choice import DEFAULT_SMS, sm_count as _sm_count
from .extents import VARLEN_CACHE, VARLEN_CACHE_START, VARLEN_NONE, VARLEN_PACKED
from .kernel_args import HEAD_DIM_ALIGN, check_offsets as _check_offsets
from .tiles import cdiv as _cdiv, next_pow2 as _next_pow2



class Packed(NamedTuple):
    """A packed variable-length batch: sequence ``s`` is query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``
    and key rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` (int32 ``(batch + 1,)`` on the tensors'
    device); ``max_seqlen_*`` bound every sequence's length (they size the grid)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class KVCache(NamedTuple):
    """A KV cache: batch element ``b`` attends cache rows ``[k_start[b], seqused_k[b])`` (clamped to
    the cache), query ``i`` of ``Lq`` at position ``seqused_k[b] - Lq + i`` under causality.
    ``seqused_k``, ``k_start``: int32 ``(B,)`` (``k_start`` None: 0). ``num_splits``: programs per
    row sharing the keys (0: :func:`num_splits_heuristic`)."""

    seqused_k: torch.Tensor
    k_start: Optional[torch.Tensor] = None
    num_splits: int = 0
MAX_SPLITS = 64
MIN_BLOCKS_PER_SPLIT = 4


def num_splits_heuristic(programs: int, key_blocks: int, sms: int = DEFAULT_SMS) -> int:
    """How many programs share each row block's keys in split-KV decoding.

    ``programs`` is the number of programs without splitting (query blocks x batch x query heads),
    ``key_blocks`` the number of key tiles of the longest row (the cache's capacity). Splitting pays
    when the unsplit grid leaves SMs idle: one wave of ``sms`` programs is the target, so the split
    count is ``sms // programs``, capped so that every split keeps at least ``MIN_BLOCKS_PER_SPLIT``
    key tiles (the merge and the per-program prologue must stay small next to the key loop) and at
    ``MAX_SPLITS``. E.g. an H100 (132 SMs), batch 1, 16 heads, one query, 8192 keys in tiles of 128:
    ``min(132 // 16, 64 // 4) = 8`` splits, 128 programs; batch 16 x 16 heads: 1 (no split)."""
    if programs <= 0:
        return 1
    return max(1, min(sms // programs, key_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))


def _stat_tensor(q):
    B, H, Lq, _ = q.shape
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty((B, H, Lq), device=q.device, dtype=dtype)


def packed_view(x):
    """``(total, H, D)`` -> the ``(1, H, total, D)`` view the kernels index (no copy)."""
    return x.unsqueeze(0).transpose(1, 2)


def check_packed_offsets(x, max_len: int):
    """Kernels index a packed sequence's rows with int32 offsets from its first row (int64)."""
    if x.is_contiguous() and x.numel() < 2**31:  # then no sequence spans 2^31 (cheap, common)
        return
    span = (max_len - 1) * abs(x.stride(0)) + sum((size - 1) * abs(st) for size, st in zip(x.shape[1:], x.stride()[1:]))
    if span >= 2**31:
        raise ValueError(f"ssa_flash: one sequence of a packed tensor of shape {tuple(x.shape)} and strides "
                         f"{x.stride()} spans {span} elements; the Triton kernels support up to 2^31")


class _Layout(NamedTuple):
    """What the kernels need to know about the layout, resolved from ``layout=``."""

    varlen: int  # VARLEN_*
    q: torch.Tensor  # 4-D views as the kernels index them
    k: torch.Tensor
    v: Optional[torch.Tensor]
    batch: int  # batch elements or packed sequences
    Lq: int  # queries per batch element (packed: the longest sequence)
    Lk: int
    cu_q: torch.Tensor  # pointer arguments (dummies where unused)
    cu_k: torch.Tensor
    seqused_k: torch.Tensor
    stat_stride_h: int  # packed: per-row statistics are (H, total_q)
    splits: int  # KV cache: programs sharing each row block's keys


def resolve_layout(q, k, v, layout) -> _Layout:
    if layout is None:
        _check_offsets(q, k, *(() if v is None else (v,)))
        return _Layout(VARLEN_NONE, q, k, v, q.shape[0], q.shape[2], k.shape[2], q, q, q, 0, 1)
    if isinstance(layout, Packed):
        check_packed_offsets(q, layout.max_seqlen_q)
        for t in (k, v):
            if t is not None:
                check_packed_offsets(t, layout.max_seqlen_k)
        pv = None if v is None else packed_view(v)
        return _Layout(VARLEN_PACKED, packed_view(q), packed_view(k), pv, layout.cu_seqlens_q.shape[0] - 1,
                       int(layout.max_seqlen_q), int(layout.max_seqlen_k), layout.cu_seqlens_q,
                       layout.cu_seqlens_k, layout.cu_seqlens_q, q.shape[0], 1)
    if isinstance(layout, KVCache):
        _check_offsets(q, k, *(() if v is None else (v,)))
        varlen = VARLEN_CACHE if layout.k_start is None else VARLEN_CACHE_START
        k_start = layout.seqused_k if layout.k_start is None else layout.k_start
        return _Layout(varlen, q, k, v, q.shape[0], q.shape[2], k.shape[2], q, k_start, layout.seqused_k,
                       0, int(layout.num_splits))
    raise TypeError(f"unknown layout {type(layout).__name__}")


def stat_for(lay: _Layout, q_orig, H):
    """A per-row statistic: ``(B, H, Lq)``, or ``(H, total_q)`` for a packed batch."""
    dtype = torch.float64 if q_orig.dtype == torch.float64 else torch.float32
    if lay.varlen == VARLEN_PACKED:
        return torch.empty((H, q_orig.shape[0]), device=q_orig.device, dtype=dtype)
    return _stat_tensor(q_orig)


def split_count(lay: _Layout, block_m: int, block_n: int, H: int, device) -> int:
    if lay.varlen < VARLEN_CACHE:
        return 1
    if lay.splits > 0:
        return lay.splits
    programs = _cdiv(lay.Lq, block_m) * lay.batch * H
    return num_splits_heuristic(programs, _cdiv(lay.Lk, block_n), _sm_count(device))


def kernel_name(base: str, lay: _Layout) -> str:
    """Kernel names for the block tables: KV-cache launches with short query blocks use the
    decoding table."""
    return base + "_decode" if lay.varlen >= VARLEN_CACHE and lay.Lq <= 16 else base


def merge_block_s(splits: int) -> int:
    return max(2, _next_pow2(splits))


def unaligned(layout, *tensors) -> bool:
    return not isinstance(layout, KVCache) and any(t.shape[-1] % HEAD_DIM_ALIGN for t in tensors)
