"""Partial attention: queries against one shard of the keys, and the merges that make the partial
results whole. The building blocks of ring attention (``ssa_flash.distributed.ring``), usable on
one process; they call the backends (``ssa_flash.backends``) and nothing that communicates.

Split the keys (and values) of every row into shards ``s = 1..m``. SSA and softmax are both a
softmax over a logit row ``l`` (``phi(z)`` or ``z``), and for the adaptive temperature over
``beta * l``; so, with ``lse_s`` the log-sum-exp of the row's logits over shard ``s`` and
``out_s`` the attention over that shard alone:

* outputs (FlashAttention's / ring attention's merge by LSE)::

      lse = logsumexp_s lse_s           out = sum_s exp(lse_s - lse) out_s

* entropy statistics of ``P = softmax(l)`` (adaptive temperature, its first pass). A shard's
  ``(lse_s, H_s)`` give its mean logit ``E_s[l] = lse_s - H_s`` under ``softmax`` over the shard,
  the whole row's mean is the LSE-weighted average ``E[l] = sum_s exp(lse_s - lse) E_s[l]``, and
  ``H = lse - E[l]``, computed without cancellation as ::

      H = sum_s w_s (H_s + lse - lse_s),      w_s = exp(lse_s - lse),  every term >= 0

  ``beta`` then comes from the whole row's ``H`` (``ssa_flash.temperature``).

* backward (docs/design.md §1.2, §1.3): given the whole row's ``out``, ``lse`` (and temperature state),
  each entry's ``dS'_ij = P'_ij (dO_i . v_j - delta_i)`` is known from one shard, so every
  gradient is a sum over shards: ``dq`` over key shards, ``dk``, ``dv`` over query shards, ``db``,
  ``dn`` over both. The adaptive temperature's ``g_i = dbeta_i dbeta/dH_i`` needs the whole row's
  ``dbeta_i = sum_j dS'_ij l_ij`` first: a pass of :func:`partial_dbeta` over the key shards,
  summed (each shard's part centred at the row's ``lse^l``, which ``sum_j dS'_ij = dlse_i`` allows:
  ``+ lse^l_i dlse_i`` once per row where a gradient reaches the LSE), then
  :func:`partial_backward` with that ``g``.

* attention sinks (docs/design.md §1.6): the sink is one more entry of every row, belonging to no
  key shard, so it is counted once per row, not once per shard: the shards run without it, and
  it joins the merged rows as one more "shard" whose output is 0, whose LSE is ``s_h`` (``beta
  s_h`` under the temperature) and whose entropy is 0 (:func:`sink_stats`, :func:`add_sink`). In
  the backward the shards' formulas already hold given the whole rows' ``out``, ``lse`` and
  temperature state (which include the sink); the sink's own terms, its part of ``dbeta`` and
  its gradient, are per-row formulas (:func:`sink_dbeta`, :func:`sink_backward`).

All of this is exact: the merged results equal the unsharded kernels' up to the rounding of
the partial outputs to the inputs' dtype and the order of floating-point sums.

Causal attention (top-left, ``j <= i``) with queries and keys cut at the same positions: a
(query shard, key shard) pair is fully visible (keys before the queries), invisible (keys after,
skip it), or diagonal (the same positions: ``spec.causal=True`` on that pair). See
:func:`causal_pair`.

Conventions (``ssa_flash.spec``): ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``,
``v (B, Hkv, Lk, Dv)`` with any strides; ``b``, ``n`` ``(Hq,)`` in the accumulation dtype
(float64 for float64 inputs, else float32) or None (softmax); per-row statistics ``(B, Hq, Lq)``
in the accumulation dtype. The functions here make per-row statistics contiguous themselves, so
slices of whole-row statistics can be passed.
"""
from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .. import backends, ops
from ..spec import AttentionSpec, KeyShardTemperature, TemperatureState, acc_dtype
from ..errors import BackendUnavailableError

__all__ = ["RowStats", "Visibility", "causal_pair", "resolve_backend", "empty_row_stats",
           "partial_entropy", "merge_entropy", "temperature_state", "partial_forward",
           "empty_output", "merge_outputs", "merge_outputs_", "partial_dbeta", "partial_backward",
           "sink_stats", "add_sink", "sink_dbeta", "sink_backward"]


class RowStats(NamedTuple):
    """Entropy statistics of ``P = softmax(l)`` per row over some keys, each ``(B, Hq, Lq)``."""

    lse: Tensor  # log-sum-exp of l over the keys (-inf where none is admissible)
    entropy: Tensor  # entropy of softmax(l) over those keys (0 where none is admissible)


class Visibility(enum.Enum):
    """How a query chunk sees a key chunk under causal (top-left) masking."""

    FULL = "full"  # every key precedes every query
    DIAGONAL = "diagonal"  # the same positions: key j visible to query i iff j <= i
    NONE = "none"  # every key follows every query


def causal_pair(q_chunk: int, k_chunk: int) -> Visibility:
    """Visibility of key chunk ``k_chunk`` from query chunk ``q_chunk`` when queries and keys are
    cut into chunks of one length at the same positions (chunk ``c`` holds positions
    ``c*C .. c*C+C-1``)."""
    if k_chunk < q_chunk:
        return Visibility.FULL
    return Visibility.DIAGONAL if k_chunk == q_chunk else Visibility.NONE


def _has_key_shard_temperature(be) -> bool:
    return isinstance(be, KeyShardTemperature)


def resolve_backend(backend: str, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec) -> str:
    """The backend name that runs partial attention of these inputs (``"auto"`` or a name, as
    in :func:`ssa_flash.ssa_attention`), or ``BackendUnavailableError`` saying why none can.
    The adaptive temperature needs a backend with ``row_dbeta``/``backward_given_g``
    (:class:`~ssa_flash.spec.KeyShardTemperature`); ``"auto"`` passes over one that
    lacks them (the CUDA backend today) to the Triton backend, or the reference backend."""
    name = ops._resolve_backend(backend, q, k, v, spec)
    if spec.adaptive and not _has_key_shard_temperature(backends.get(name)):
        if backend != "auto":
            raise BackendUnavailableError(
                f"backend={name!r} cannot run the adaptive temperature over key shards (it has no "
                "row_dbeta/backward_given_g); use backend='triton' or 'reference'")
        name = "reference" if backends.resolve("triton", q.device, q.dtype)[1] else "triton"
    return name


def _stat(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.contiguous()


def _temp(temp: Optional[TemperatureState]) -> Optional[TemperatureState]:
    return None if temp is None else TemperatureState(*(t.contiguous() for t in temp))


# --------------------------------------------------------------------------------------------
# Forward: entropy statistics (adaptive temperature) and outputs


def empty_row_stats(q: Tensor) -> RowStats:
    """Statistics over no keys (lse ``-inf``, entropy 0) for the rows of ``q``: the identity of
    :func:`merge_entropy`."""
    B, H, Lq, _ = q.shape
    acc = acc_dtype(q.dtype)
    return RowStats(torch.full((B, H, Lq), float("-inf"), dtype=acc, device=q.device),
                    torch.zeros((B, H, Lq), dtype=acc, device=q.device))


def partial_entropy(q: Tensor, k: Tensor, params: Tuple[Tensor, ...],
                    spec: AttentionSpec, backend: str) -> RowStats:
    """Entropy statistics of ``softmax(l)`` over the keys of ``k`` alone (``spec.causal``: the
    diagonal pair of a causal split). No temperature; ``spec.adaptive`` is ignored."""
    ent, lse = backends.get(backend).row_entropy(q, k, None, params, None, spec)
    return RowStats(lse, ent)


def merge_entropy(x: RowStats, y: RowStats) -> RowStats:
    """Statistics over the union of two disjoint key sets, from each set's (module docstring).
    Associative and commutative up to rounding; ``empty_row_stats`` is its identity."""
    lse = torch.logaddexp(x.lse, y.lse)
    ref = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)  # rows with no key
    ent = torch.zeros_like(lse)
    for part in (x, y):
        w = torch.exp(part.lse - ref)
        # a set without admissible keys (lse -inf) weighs 0; keep inf - inf out of the sum
        ent = ent + torch.where(w > 0, w * (part.entropy + (ref - part.lse)), torch.zeros_like(w))
    return RowStats(lse, ent)


def temperature_state(stats: RowStats, spec: AttentionSpec) -> TemperatureState:
    """The adaptive temperature of whole rows from their merged statistics: ``beta`` and
    ``d beta / d H`` (``ssa_flash.backends.beta_from_entropy`` with ``spec.poly`` and
    ``spec.threshold``), packed with the statistics for the backward."""
    beta, dbeta_dh = backends.beta_from_entropy(stats.entropy, spec.poly, spec.threshold)
    return TemperatureState(beta, stats.lse, stats.entropy, dbeta_dh)


def partial_forward(q: Tensor, k: Tensor, v: Tensor, params: Tuple[Tensor, ...],
                    beta: Optional[Tensor], spec: AttentionSpec, backend: str) -> Tuple[Tensor, Tensor]:
    """``(out (B, Hq, Lq, Dv) in q's dtype, lse (B, Hq, Lq))``: attention of ``q`` over the keys of
    ``k``/``v`` alone, i.e. ``softmax(beta * l)`` restricted to them (``beta``: the whole rows'
    temperature, given iff ``spec.adaptive``). Rows with no admissible key: out 0, lse -inf."""
    if spec.adaptive and beta is None:
        raise ValueError("partial_forward: spec.adaptive needs beta (temperature_state of the whole rows)")
    return backends.get(backend).forward(q, k, v, None, params, None, _stat(beta) if spec.adaptive else None,
                                         spec)


def empty_output(q: Tensor, dv: int) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` over no keys: zeros ``(B, Hq, Lq, dv)`` and ``-inf`` ``(B, Hq, Lq)`` in the
    accumulation dtype, the identity of :func:`merge_outputs`."""
    B, H, Lq, _ = q.shape
    acc = acc_dtype(q.dtype)
    return (torch.zeros((B, H, Lq, dv), dtype=acc, device=q.device),
            torch.full((B, H, Lq), float("-inf"), dtype=acc, device=q.device))


def merge_outputs(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """Attention over the union of two disjoint key sets from each set's ``(out, lse)``:
    ``lse = logaddexp(lse_a, lse_b)``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``.
    ``out_*`` ``(..., Lq, Dv)``, ``lse_*`` ``(..., Lq)``; returns ``out`` in the dtype of ``lse_a``
    (the accumulation dtype: keep merging in it and cast once at the end). A row empty in both
    stays out 0, lse -inf."""
    acc = lse_a.dtype
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - ref).unsqueeze(-1)
    wb = torch.exp(lse_b - ref).unsqueeze(-1)
    return wa * out_a.to(acc) + wb * out_b.to(acc), lse


def merge_outputs_(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """:func:`merge_outputs` in place: ``(out, lse)`` (accumulation dtype, views allowed, e.g.
    rows of a larger accumulator) become the merge of themselves with ``(part_out, part_lse)``.
    Allocates one temporary of ``part_out``'s size in the accumulation dtype."""
    new = torch.logaddexp(lse, part_lse)
    ref = torch.where(new == float("-inf"), torch.zeros_like(new), new)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1))
    out.add_(part_out * torch.exp(part_lse - ref).unsqueeze(-1))
    lse.copy_(new)


# --------------------------------------------------------------------------------------------
# Backward


def partial_dbeta(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  params: Tuple[Tensor, ...], temp: TemperatureState,
                  spec: AttentionSpec, backend: str, dlse: Optional[Tensor] = None) -> Tensor:
    """``(B, Hq, Lq)``: this key shard's part of ``dbeta_i = sum_j dS'_ij l_ij`` (adaptive only),
    centred: ``sum_j dS'_ij (l_ij - lse^l_i)`` with ``lse^l = temp.lse_l``. ``out``, ``lse``,
    ``temp`` (and ``dlse``, the gradient reaching ``lse`` if any) are those of the whole rows.
    Sum over the key shards (and :func:`sink_dbeta`), add ``temp.lse_l * dlse`` once if ``dlse``
    is given, then ``g = dbeta * temp.dbeta_dh``."""
    if not spec.adaptive:
        raise ValueError("partial_dbeta is for the adaptive temperature (spec.adaptive) only")
    be = backends.get(backend)
    if not _has_key_shard_temperature(be):
        raise BackendUnavailableError(f"backend={backend!r} has no row_dbeta (see resolve_backend)")
    return be.row_dbeta(dout, q, k, v, out, _stat(lse), _stat(dlse), None, params, _temp(temp), spec)


def partial_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     params: Tuple[Tensor, ...], spec: AttentionSpec, backend: str,
                     temp: Optional[TemperatureState] = None, g: Optional[Tensor] = None,
                     dlse: Optional[Tensor] = None
                     ) -> Tuple[Tensor, Tensor, Tensor, Tuple[Tensor, ...]]:
    """This (query shard, key shard) pair's contributions ``(dq, dk, dv, dparams)`` to the
    gradients: ``dq`` ``(B, Hq, Lq, D)`` in q's dtype (sum over key shards), ``dk``, ``dv`` for
    the shard's keys in k's dtype (sum over query shards), ``dparams`` one ``(Hq,)`` tensor in the
    accumulation dtype per score parameter (sum over all pairs).

    ``dout`` is the gradient of the whole rows' output; ``out``, ``lse`` and (adaptive) ``temp``
    are those of the whole rows, ``g = dbeta * temp.dbeta_dh`` the whole rows' temperature
    gradient (the sum of :func:`partial_dbeta` over the key shards); ``dlse`` the gradient reaching
    ``lse``, if any."""
    be = backends.get(backend)
    if spec.adaptive:
        if temp is None or g is None:
            raise ValueError("partial_backward: spec.adaptive needs temp and g of the whole rows")
        if not _has_key_shard_temperature(be):
            raise BackendUnavailableError(f"backend={backend!r} has no backward_given_g (see resolve_backend)")
        return be.backward_given_g(dout, q, k, v, out, _stat(lse), _stat(dlse), None, params, _temp(temp),
                                   _stat(g), spec)
    return be.backward(dout, q, k, v, out, _stat(lse), _stat(dlse), None, params, None, None, spec)[:4]


# --------------------------------------------------------------------------------------------
# Attention sinks: one entry per row, added once to the merged rows (module docstring)


def _sink_rows(sinks: Tensor, like: Tensor) -> Tensor:
    """``sinks (Hq,)`` broadcast to the per-row shape ``(B, Hq, Lq)`` of ``like``."""
    return sinks.to(like.dtype).view(1, -1, 1).expand_as(like)


def _exp_or_zero(x: Tensor, s: Tensor) -> Tensor:
    """``exp(x)`` where the sink logit ``s`` is finite, else 0 (a sink of -inf has no weight;
    its row's statistics may be -inf too, and -inf - (-inf) is NaN)."""
    return torch.where(torch.isfinite(s), torch.exp(torch.where(torch.isfinite(s), x, torch.zeros_like(x))),
                       torch.zeros_like(x))


def sink_stats(sinks: Tensor, like: Tensor) -> RowStats:
    """The sink as statistics of its own (adaptive temperature, first pass): ``lse = s_h``,
    entropy 0, shaped like ``like`` ``(B, Hq, Lq)``; :func:`merge_entropy` them into the merged
    key shards' statistics once."""
    lse = _sink_rows(sinks, like).clone()
    return RowStats(lse, torch.zeros_like(lse))


def add_sink(out: Tensor, lse: Tensor, sinks: Tensor, beta: Optional[Tensor] = None) -> None:
    """Adds the sink to merged rows in place: ``(out, lse)`` (accumulation dtype, over every key
    shard) become the attention over ``[keys, sink]``: ``lse' = logaddexp(lse, beta s_h)``,
    ``out' = exp(lse - lse') out`` (the sink's value is 0). ``beta``: the rows' temperature, or
    None (1)."""
    s = _sink_rows(sinks, lse)
    sl = s if beta is None else beta.to(lse.dtype) * s
    sl = torch.where(torch.isfinite(s), sl, s)  # beta * -inf stays -inf
    new = torch.logaddexp(lse, sl)
    ref = torch.where(new == float("-inf"), torch.zeros_like(new), new)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1))
    lse.copy_(new)


def _sink_ds(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor, beta: Optional[Tensor],
             dlse: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(s, dS'_sink)`` per row: the sink logit and ``P'_sink (0 - delta)`` (its value is 0, so
    ``dP'_sink = 0``), ``delta = rowsum(dout * out) - dlse``."""
    acc = lse.dtype
    s = _sink_rows(sinks, lse)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    sl = s if beta is None else beta.to(acc) * s
    p_sink = _exp_or_zero(sl - lse, s)
    return s, -p_sink * delta


def _sink_log_p(s: Tensor, temp: TemperatureState, dtype: torch.dtype) -> Tensor:
    """``log P_sink = s_h - lse^l`` per row (the temperature-free weight's log), 0 where the sink
    is ``-inf`` (then it has no term; where it is finite, ``lse^l >= s_h`` is finite too)."""
    finite = torch.isfinite(s)
    return torch.where(finite, s - torch.where(finite, temp.lse_l.to(dtype), torch.zeros_like(s)),
                       torch.zeros_like(s))


def sink_dbeta(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor, temp: TemperatureState,
               dlse: Optional[Tensor] = None) -> Tensor:
    """``(B, Hq, Lq)``: the sink's part of ``dbeta_i``, centred as :func:`partial_dbeta`'s
    (``dS'_sink (s_h - lse^l_i)``; adaptive only), to add once to the sum of
    :func:`partial_dbeta` over the key shards. Whole rows' tensors."""
    s, ds = _sink_ds(dout, out, lse, sinks, temp.beta, dlse)
    return torch.where(torch.isfinite(s), ds * _sink_log_p(s, temp, ds.dtype), torch.zeros_like(ds))


def sink_backward(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor,
                  temp: Optional[TemperatureState] = None, g: Optional[Tensor] = None,
                  dlse: Optional[Tensor] = None) -> Tensor:
    """``dsinks (Hq,)``: the gradient of the sink logits from these rows, ``sum_{b,i} dl_sink``
    with ``dl_sink = dS'_sink`` (fixed temperature) or ``beta dS'_sink - g P_sink (log P_sink +
    H)`` (adaptive: ``temp`` and ``g``, the whole rows' temperature gradient including the
    sink's :func:`sink_dbeta`). Whole rows' tensors; sum over the query shards (ranks)."""
    s, ds = _sink_ds(dout, out, lse, sinks, temp.beta if temp is not None else None, dlse)
    dl = ds
    if temp is not None:
        if g is None:
            raise ValueError("sink_backward: the adaptive temperature needs g of the whole rows")
        acc = lse.dtype
        logp = _sink_log_p(s, temp, acc)
        p = _exp_or_zero(logp, s)
        dl = temp.beta.to(acc) * ds - g.to(acc) * p * (logp + temp.entropy.to(acc))
    return dl.sum(dim=(0, 2))
