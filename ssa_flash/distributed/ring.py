"""Ring attention over ``torch.distributed``: SSA, softmax and the adaptive temperature on a
sequence sharded across the ranks of a process group (docs/design.md §1.5; docs/distributed.md).

Every rank holds its shard of the queries, keys and values (:func:`shard_sequence`). The
key/value shards travel around the ring of ranks (rank ``r`` sends to ``r + 1`` and receives
from ``r - 1``, point-to-point with ``torch.distributed.batch_isend_irecv``); at each of the
``W`` steps a rank attends its queries to the shard it holds, through the partial attention of
``ssa_flash.distributed.partial``, while the next shard is already on its way (the transfer is
started before the computation). Partial results merge by LSE, which is exact.

* forward: one ring pass over ``(k, v)`` merging ``(out, lse)``; with the adaptive temperature a
  pass over ``k`` alone first, merging each row's entropy statistics, so that every row's
  ``beta`` comes from its entropy over the whole sequence.
* backward: one ring pass over ``(k, v)`` in which the ``dk``/``dv`` partials travel with their
  shard (in the accumulation dtype), each rank adding its queries' contributions, and one last
  transfer hands each shard's complete ``dk``/``dv`` back to its owner; ``dq`` stays local. With
  the adaptive temperature a pass over ``(k, v)`` first sums each row's ``dbeta`` (the
  temperature gradient needs it over the whole row). the score parameters' gradients are all-reduced.
* causal: each rank holds two chunks of the sequence cut in ``2W`` chunks, ``r`` and
  ``2W - 1 - r`` (zig-zag), so that every rank does the same work at every step: its own shard is
  the diagonal block (causal within the shard, whose two chunks are in order), a shard from a
  lower rank is seen fully by all local queries through its first chunk only, and a shard from a
  higher rank is seen fully by the local second chunk only. Half a block per step, on every rank.

Communication per rank and step: the key/value shard (``2 * L/W * Hkv * D`` elements in the
inputs' dtype) forward and backward, plus the ``dk``/``dv`` partials (the same count, in the
accumulation dtype) in the backward; the adaptive temperature adds one shard pass (keys only) to
the forward and one to the backward.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops
from ..spec import AttentionSpec, TemperatureState, acc_dtype
from ..conventions import DEFAULT_POLY, DEFAULT_THRESHOLD
from . import partial as P

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "shard_positions"]


# --------------------------------------------------------------------------------------------
# Process group, layout


def _resolve_group(group):
    """The process group (``None``: the default one), checked to be usable."""
    if not dist.is_available():
        raise ValueError("group: torch.distributed is not available in this build of torch")
    if not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised; call "
                         "torch.distributed.init_process_group first (torchrun sets its environment)")
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return group


def _check_dim(dim, x: Tensor) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of {x.dim()} dims")
    return dim % x.dim()


def shard_sequence(x: Tensor, group=None, dim: int = 2, is_causal: bool = False) -> Tensor:
    """This rank's part of the whole-sequence tensor ``x``, in the layout :func:`ring_attention`
    expects: with ``W`` ranks in ``group`` and ``L = x.shape[dim]``,

    * ``is_causal=False``: the ``r``-th of ``W`` equal contiguous chunks (``L`` divisible by ``W``);
    * ``is_causal=True``: chunks ``r`` and ``2W - 1 - r`` of ``2W`` equal chunks, concatenated in
      that order (zig-zag, ``L`` divisible by ``2W``), which balances causal work over the ranks.

    ``dim=2`` is the sequence dim of ``(B, H, L, D)``; use ``dim=1`` for ``(B, L, H, D)`` (e.g. token
    embeddings or position ids before the heads are split). Differentiable (a view for
    ``is_causal=False``, a concatenation of two views otherwise). Communicates nothing: every rank
    must hold the same ``x``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _check_dim(dim, x)
    ops._check_bool("is_causal", is_causal)
    group = _resolve_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    length = x.shape[dim]
    parts = 2 * world if is_causal else world
    if length % parts != 0 or length == 0:
        layout = f"2 * world size = {parts} (causal zig-zag chunks)" if is_causal else f"the world size {parts}"
        raise ValueError(f"x: sequence length {length} (dim {dim}) must be a positive multiple of {layout}")
    chunk = length // parts
    if not is_causal:
        return x.narrow(dim, rank * chunk, chunk)
    return torch.cat([x.narrow(dim, rank * chunk, chunk), x.narrow(dim, (parts - 1 - rank) * chunk, chunk)], dim)


def unshard_sequence(x: Tensor, group=None, dim: int = 2, is_causal: bool = False) -> Tensor:
    """The inverse of :func:`shard_sequence`: gathers every rank's shard (all of the same shape)
    into the whole-sequence tensor, on every rank (an all-gather). Not differentiable: the result
    is detached (compute losses on the local shards instead; ring attention's gradients are those
    of the sum of the ranks' losses)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _check_dim(dim, x)
    ops._check_bool("is_causal", is_causal)
    group = _resolve_group(group)
    world = dist.get_world_size(group)
    if is_causal and x.shape[dim] % 2 != 0:
        raise ValueError(f"x: a causal shard holds two equal chunks, but its length {x.shape[dim]} (dim {dim}) is odd")
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    if not is_causal:
        return torch.cat(parts, dim)
    chunks: List[Optional[Tensor]] = [None] * (2 * world)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * world - 1 - r] = part.chunk(2, dim)
    return torch.cat(chunks, dim)


def shard_positions(seq_len: int, group=None, is_causal: bool = False, device=None) -> Tensor:
    """The positions in the whole sequence (int64, ``(seq_len / W,)``) of this rank's tokens in
    :func:`shard_sequence`'s layout: for position ids or rotary embeddings of sharded tokens."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise TypeError(f"seq_len must be an int, got {type(seq_len).__name__}")
    return shard_sequence(torch.arange(seq_len, device=device), group, dim=0, is_causal=is_causal)


# --------------------------------------------------------------------------------------------
# The ring


class _Transfer:
    """Point-to-point transfers under way; :meth:`wait` returns the received tensors."""

    def __init__(self, requests, received: List[Tensor]):
        self._requests = requests
        self._received = received

    def wait(self) -> List[Tensor]:
        for req in self._requests:
            req.wait()
        return self._received


class _Ring:
    """The ring of a process group: rank ``r`` sends to ``r + 1`` and receives from ``r - 1``."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def shift(self, tensors: Sequence[Tensor]) -> _Transfer:
        """Starts sending ``tensors`` (contiguous) to the next rank and receiving the previous
        rank's (same shapes and dtypes) into new buffers. Every rank must call it in the same
        order; the sent tensors must not change until :meth:`_Transfer.wait` returns."""
        received = [torch.empty_like(t) for t in tensors]
        p2p = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        p2p += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return _Transfer(dist.batch_isend_irecv(p2p), received)

    def circulate(self, tensors: Sequence[Tensor], visit: Callable[[int, Sequence[Tensor]], None]) -> None:
        """Calls ``visit(src, tensors_of_src)`` for every rank ``src`` of the ring, starting with
        this rank's own; each shard is sent on before it is visited, so the transfer of the next
        overlaps the computation on the current one."""
        for step in range(self.world):
            pending = self.shift(tensors) if step < self.world - 1 else None
            visit((self.rank - step) % self.world, tensors)
            if pending is not None:
                tensors = pending.wait()


def _block(rank: int, src: int, causal: bool, lq: int, lk: int) -> Optional[Tuple[slice, slice, bool]]:
    """``(query rows, key rows, diagonal)`` of this rank's queries that see the key shard of rank
    ``src``, and whether that block is causal within itself; None if none (never, with zig-zag)."""
    if not causal:
        return slice(0, lq), slice(0, lk), False
    if src == rank:  # chunks (r, 2W-1-r) against themselves: in order, causal within
        return slice(0, lq), slice(0, lk), True
    if src < rank:  # its first chunk precedes both of ours, its second follows both
        return slice(0, lq), slice(0, lk // 2), False
    return slice(lq // 2, lq), slice(0, lk), False  # both of its chunks lie between ours


@dataclasses.dataclass(frozen=True)
class _Config:
    ring: _Ring
    spec: AttentionSpec
    backend: str
    reduce_param_grads: bool


def _rows(t: Tensor, rows: slice) -> Tensor:
    """Rows of a ``(B, H, L, ...)`` tensor or ``(B, H, L)`` statistics."""
    return t[:, :, rows]


def _ring_forward(cfg: _Config, q, k, v, params, sinks):
    """``(out in q's dtype, lse, temp or None)`` of this rank's queries over the whole sequence
    (and the sink, counted once per row: ``partial``'s module docstring)."""
    ring, spec, backend = cfg.ring, cfg.spec, cfg.backend
    lq, lk = q.shape[2], k.shape[2]
    temp = None
    if spec.adaptive:
        lse_l, ent = P.empty_row_stats(q)

        def visit_stats(src, shard):
            qs, ks, diag = _block(ring.rank, src, spec.causal, lq, lk)
            part = P.partial_entropy(_rows(q, qs), _rows(shard[0], ks), params,
                                     dataclasses.replace(spec, causal=diag), backend)
            merged = P.merge_entropy(P.RowStats(_rows(lse_l, qs), _rows(ent, qs)), part)
            _rows(lse_l, qs).copy_(merged.lse)
            _rows(ent, qs).copy_(merged.entropy)

        ring.circulate([k], visit_stats)
        stats = P.RowStats(lse_l, ent)
        if sinks is not None:
            stats = P.merge_entropy(stats, P.sink_stats(sinks, lse_l))
        temp = P.temperature_state(stats, spec)

    out, lse = P.empty_output(q, v.shape[-1])

    def visit(src, shard):
        qs, ks, diag = _block(ring.rank, src, spec.causal, lq, lk)
        beta = _rows(temp.beta, qs) if spec.adaptive else None
        part_out, part_lse = P.partial_forward(_rows(q, qs), _rows(shard[0], ks), _rows(shard[1], ks), params,
                                               beta, dataclasses.replace(spec, causal=diag), backend)
        P.merge_outputs_(_rows(out, qs), _rows(lse, qs), part_out, part_lse)

    ring.circulate([k, v], visit)
    if sinks is not None:
        P.add_sink(out, lse, sinks, temp.beta if spec.adaptive else None)
    return out.to(q.dtype), lse, temp


def _ring_backward(cfg: _Config, dout, q, k, v, out, lse, params, sinks, temp: Optional[TemperatureState]):
    """``(dq, dk, dv, dparams, dsinks)`` of this rank's shards (``dparams``, ``dsinks``: this rank's
    queries' part)."""
    ring, spec, backend = cfg.ring, cfg.spec, cfg.backend
    lq, lk = q.shape[2], k.shape[2]
    acc = acc_dtype(q.dtype)

    def rows_temp(qs):
        return TemperatureState(*(_rows(t, qs) for t in temp))

    g = None
    if spec.adaptive:  # g_i = dbeta_i dbeta/dH_i needs dbeta_i over the whole row first
        dbeta = torch.zeros_like(lse)

        def visit_dbeta(src, shard):
            qs, ks, diag = _block(ring.rank, src, spec.causal, lq, lk)
            _rows(dbeta, qs).add_(P.partial_dbeta(
                _rows(dout, qs), _rows(q, qs), _rows(shard[0], ks), _rows(shard[1], ks), _rows(out, qs),
                _rows(lse, qs), params, rows_temp(qs), dataclasses.replace(spec, causal=diag), backend))

        ring.circulate([k, v], visit_dbeta)
        if sinks is not None:  # the sink's term, once per row
            dbeta += P.sink_dbeta(dout, out, lse, sinks, temp)
        g = dbeta * temp.dbeta_dh
    dsinks = None
    if sinks is not None:
        dsinks = P.sink_backward(dout, out, lse, sinks, temp, g)

    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dparams = [torch.zeros(q.shape[1], dtype=acc, device=q.device) for _ in params]
    shard = [k, v]
    dshard = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
    pending_shard = pending_grads = None
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        if step < ring.world - 1:
            pending_shard = ring.shift(shard)
        qs, ks, diag = _block(ring.rank, src, spec.causal, lq, lk)
        dq_p, dk_p, dv_p, dparams_p = P.partial_backward(
            _rows(dout, qs), _rows(q, qs), _rows(shard[0], ks), _rows(shard[1], ks), _rows(out, qs),
            _rows(lse, qs), params, dataclasses.replace(spec, causal=diag), backend,
            temp=rows_temp(qs) if spec.adaptive else None, g=_rows(g, qs) if spec.adaptive else None)
        if pending_grads is not None:  # this shard's dk/dv so far, from the ranks before us
            dshard = pending_grads.wait()
        _rows(dq, qs).add_(dq_p)
        _rows(dshard[0], ks).add_(dk_p)
        _rows(dshard[1], ks).add_(dv_p)
        for acc_p, part in zip(dparams, dparams_p):
            acc_p += part
        if ring.world > 1:  # on with the shard's dk/dv (after the last step: home to its owner)
            pending_grads = ring.shift(dshard)
        if pending_shard is not None:
            shard = pending_shard.wait()
            pending_shard = None
    if pending_grads is not None:
        dshard = pending_grads.wait()
    return dq.to(q.dtype), dshard[0].to(k.dtype), dshard[1].to(v.dtype), dparams, dsinks


class _RingAttention(torch.autograd.Function):
    """Ring attention of local shards; differentiable in q, k, v, sinks and the score parameters."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cfg: _Config, *params):
        out, lse, temp = _ring_forward(cfg, q, k, v, params, sinks)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, out, lse, sinks, *(temp if temp is not None else ()), *params)
        return out

    @staticmethod
    def backward(ctx, dout):
        cfg: _Config = ctx.cfg
        q, k, v, out, lse, sinks, *rest = ctx.saved_tensors
        n_temp = len(TemperatureState._fields) if cfg.spec.adaptive else 0
        temp = TemperatureState(*rest[:n_temp]) if cfg.spec.adaptive else None
        params = tuple(rest[n_temp:])
        dq, dk, dv, dparams, dsinks = _ring_backward(cfg, dout, q, k, v, out, lse, params, sinks, temp)
        # whether or not the parameters and sinks need gradients here: every rank must make the
        # same collective calls
        if cfg.reduce_param_grads and cfg.ring.world > 1:
            grads = list(dparams) + ([dsinks] if dsinks is not None else [])
            if grads:
                both = torch.stack(grads)
                dist.all_reduce(both, group=cfg.ring.group)  # the same sum on every rank
                dparams = list(both[:len(dparams)])
                dsinks = both[len(dparams)] if dsinks is not None else None
        return (dq, dk, dv, dsinks, None, *dparams)


def ring_attention(query: Tensor, key: Tensor, value: Tensor, group=None, is_causal: bool = False,
                   scale: Optional[float] = None, enable_gqa: bool = False, *, score: Optional[str] = None,
                   score_params=None, adaptive_temperature: bool = False,
                   poly: Sequence[float] = DEFAULT_POLY, threshold: float = DEFAULT_THRESHOLD,
                   backend: str = "auto", reduce_param_grads: bool = True, sinks=None,
                   softcap: float = 0.0) -> Tensor:
    """Attention of a sequence sharded over the ranks of ``group``; each rank passes its shards
    and gets its shard of the output. Equals the unsharded attention of the whole tensors
    (:func:`ssa_flash.ssa_attention`, ``softmax_attention``, ``adaptive_temperature_attention``),
    outputs and gradients, up to floating-point rounding (the order of sums, partial outputs and
    ``dq`` partials rounded to the inputs' dtype before an accumulation in float32).

    Args:
        query: ``(B, Hq, Lq, D)``, this rank's query shard; key ``(B, Hkv, Lk, D)``, value
            ``(B, Hkv, Lk, Dv)``: its key/value shard. Every rank's shards have the same shapes.
            Layout: :func:`shard_sequence` of the whole tensors (contiguous chunks, or with
            ``is_causal`` the zig-zag chunks ``r`` and ``2W - 1 - r``).
        group: the process group whose ranks hold the shards (``None``: the default group).
        is_causal: causal attention (``j <= i``) over the whole sequence; needs ``Lq == Lk``
            (even: two chunks) and the zig-zag layout.
        scale, enable_gqa: as in ``scaled_dot_product_attention``.
        score, score_params: the score function and its per-head parameters, as in
            :func:`ssa_flash.attention` (the same on every rank; gradients flow to tensors);
            None (the default): softmax. SSA: ``score="ssa", score_params={"b": b, "n": n}``.
        adaptive_temperature: the entropy-driven temperature of "Softmax is not Enough" (with
            ``poly``, ``threshold``), each row's entropy taken over the whole sequence.
        backend: "auto", "triton", "cuda" or "reference" (the backend interface's explicit
            formulas, O(L^2/W^2) memory per step: for tests), as in ``ssa_attention``. The
            adaptive temperature needs the Triton or reference backend ("auto" picks one).
        reduce_param_grads: the score parameters' (and ``sinks``') gradients all-reduced (summed) over
            ``group``, so that every rank gets the whole gradient, identical on every rank (the
            default). False: each rank gets its own queries' part; for a data-parallel wrapper
            (DDP, FSDP) reducing parameter gradients over these ranks itself
            (``RingSSAttention``'s default).
        sinks, softcap: as in :func:`ssa_flash.ssa_attention` (``sinks`` the same on every rank).
            The sink is one entry of each row, counted once per row (not once per key shard):
            the key shards run without it and it joins the merged rows.

    Returns:
        this rank's output shard ``(B, Hq, Lq, Dv)`` in the inputs' dtype.

    Gradients of q, k, v on each rank are those of the sum of all ranks' losses with respect to
    its shards. Like any collective, every rank of ``group`` must make the same calls, forward
    and backward, in the same order.
    """
    ops._check_bool("is_causal", is_causal)
    ops._check_bool("enable_gqa", enable_gqa)
    ops._check_bool("adaptive_temperature", adaptive_temperature)
    ops._check_bool("reduce_param_grads", reduce_param_grads)
    group = _resolve_group(group)
    for name, x in (("query", query), ("key", key), ("value", value)):
        ops._check_tensor(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (B, H, L/W, D), got shape {tuple(x.shape)}")
    gqa = ops._check_qkv(query, key, value, enable_gqa)
    scale = ops._check_common(0.0, is_causal, scale, query.shape[-1], False)
    lq, lk = query.shape[2], key.shape[2]
    if min(lq, lk, query.shape[-1], value.shape[-1]) == 0 or query.numel() == 0:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} "
                         "shards must have rows, keys and head dims")
    if is_causal and (lq != lk or lq % 2 != 0):
        raise ValueError(f"is_causal: the query and key shards must have one even length (two zig-zag "
                         f"chunks, see shard_sequence), got query length {lq}, key length {lk}")
    score, params, poly, threshold, sinks, softcap = ops._check_variant(
        query, "softmax" if score is None else score, score_params, adaptive_temperature, poly, threshold, sinks,
        softcap)
    spec = AttentionSpec(scale=scale, score=score.name, causal=is_causal, group=gqa, adaptive=adaptive_temperature,
                         poly=poly, threshold=threshold, softcap=softcap)
    name = P.resolve_backend(backend, query, key, value, spec)  # the shards run without the sink
    cfg = _Config(_Ring(group), spec, name, reduce_param_grads)
    return _RingAttention.apply(query, key.contiguous(), value.contiguous(), sinks, cfg, *params)
