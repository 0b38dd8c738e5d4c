"""The interface between the custom ops and the backends (the contract: the kernel layers take
these types, and this module imports nothing above ``ssa_flash.conventions``).

* :class:`AttentionSpec`: what to compute, apart from the tensors. Its fields are also the trailing
  arguments of every ``torch.ops.ssa_flash`` op: :meth:`AttentionSpec.schema` writes them into the
  op schemas, :meth:`AttentionSpec.op_args` / :meth:`AttentionSpec.from_op_args` convert, so a new
  option (``dropout_p``, ``window_left``/``window_right``, ...) is one new field here plus its use
  in the backends: the ops, their fake implementations and the autograd formula pass it through
  untouched (tensor-valued fields, ``dropout_rng``, are saved for the backward with
  ``save_for_backward``: see :data:`TENSOR_FIELDS`).
* :class:`TemperatureState`: the adaptive temperature's per-row tensors kept for the backward.
* :class:`Backend`: the functions each backend module provides (``ssa_flash.backends.triton_backend``,
  ``.cuda``, ``.reference``); optionally ``prepare``, a :class:`PreparedCall` per specialisation
  (the host path of repeated calls: ``ssa_flash.ops``' call plans hold it; :class:`PlanMismatch`).
* :class:`KeyShardTemperature`: two more functions, optional, that a caller holding only a shard
  of the keys needs for the adaptive temperature's backward (ring attention); the Triton and
  reference backends provide them.

Tensor conventions (all backends; inputs arrive validated by ``ssa_flash.ops``):

* ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)``, any strides, one dtype among
  float16 / bfloat16 / float32 / float64 (each backend says which it takes, see ``supports``);
  ``Hq = group * Hkv``; ``B * Hq * Lq > 0``, ``Lk > 0``, ``D > 0``, ``Dv > 0``.
* Packed variable-length batch (``spec.cu_seqlens_q`` given, ``varlen_attention``): ``q (total_q, Hq, D)``,
  ``k (total_k, Hkv, D)``, ``v (total_k, Hkv, Dv)``, outputs ``(total_q, Hq, Dv)`` and per-row
  statistics ``(Hq, total_q)``; no mask. Sequence ``s`` is rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``
  of q attending to rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` of k, v, every rule applied inside it.
* KV cache (``spec.seqused_k`` given, ``attention_with_kvcache``): dense layouts, but batch element
  ``b`` attends only key rows ``[k_start[b], seqused_k[b])`` and ``causal`` is bottom-right (query
  ``i`` of ``Lq`` is at key position ``seqused_k[b] - Lq + i``); forward and ``row_entropy`` only.
  Backends that do not implement a layout say so in ``supports``.
* ``mask``: None, or a bool (True = attend) / floating (added to the logit row) tensor expanded,
  as a view with zero strides where broadcast, to ``(B, Hq, Lq, Lk)``.
* ``params``: the score function's per-head parameters (``ssa_flash.scores``; the function is
  ``spec.score``), a tuple with one ``(Hq,)`` contiguous tensor in the accumulation dtype (float64
  for float64 inputs, else float32) per name in ``scores.get(spec.score).params``, in that order:
  ``()`` for softmax, ``(b, n)`` for SSA's ``phi(z) = n sgn(z) log1p(b|z|)``, ``(s,)`` for the
  logit scale ``phi(z) = s z``. A backend whose kernels do not implement ``spec.score`` says so in
  ``supports``. Gradients come back the same way: ``dparams``, one ``(Hq,)`` tensor in the
  accumulation dtype per parameter (``()`` for softmax).
* ``sinks``: None, or an ``(Hq,)`` contiguous tensor in the accumulation dtype: the sink logit
  ``s_h`` appended, with a zero value vector, to every logit row of query head ``h``
  (docs/design.md §1.6). The row is then ``[l, s_h]``: its weights sum to ``1 - P_sink``, the LSE,
  the entropy and (adaptive) ``beta * [l, s_h]`` include the sink, and a row with no admissible
  key has output 0 and LSE ``beta s_h`` (``s_h = -inf``: as without a sink). A backend whose
  kernels do not implement sinks (or ``spec.softcap > 0``) says so in ``supports``.
* per-row statistics (``lse``, ``beta``, ``entropy``, ...): ``(B, Hq, Lq)`` contiguous, in the
  accumulation dtype. Outputs and gradients of q, k, v: contiguous, in the inputs' dtype.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch
from torch import Tensor

from . import scores
from .conventions import DEFAULT_POLY, DEFAULT_THRESHOLD, NO_WINDOW

__all__ = ["AttentionSpec", "TemperatureState", "Backend", "PreparedCall", "PlanMismatch", "KeyShardTemperature",
           "acc_dtype", "draw_dropout_rng",
           "TENSOR_FIELDS"]

# Python field type -> torch.library schema type. Tensor-valued options (cu_seqlens, a KV cache's
# lengths; a Philox seed/offset that must live on the device for CUDA-graph capture) are
# "Optional[Tensor]" -> "Tensor?": declare them with ``field(default=None, compare=False)`` (they are
# data, like q, k, v: not part of a spec's equality or hash); the autograd formula saves them with
# save_for_backward (``ssa_flash.autograd``).
_SCHEMA_TYPES = {
    float: "float",
    int: "int",
    bool: "bool",
    str: "str",
    Tuple[float, ...]: "float[]",
    Tuple[int, ...]: "int[]",
    Optional[Tensor]: "Tensor?",
}


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def draw_dropout_rng(device) -> Tensor:
    """The ``(seed, offset)`` pair (int64 tensor ``(2,)`` on ``device``) of one dropout call
    (:attr:`AttentionSpec.dropout_rng`), drawn from torch's default generator for ``device``, so
    ``torch.manual_seed`` before a call decides its mask. Drawn on the device (no host
    synchronisation; inside a CUDA graph each replay draws anew)."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


@dataclass(frozen=True)
class AttentionSpec:
    """What the backends compute, apart from the tensors (docs/design.md §1).

    The score function's parameters are tensors, so they travel beside the spec (``params``), not in it.
    ``score_fn``: the :class:`~ssa_flash.scores.ScoreFunction` that ``score`` names, resolved once at
    construction (None for an unknown name, which the backends' ``supports`` report); the backends
    and the kernels' launchers take it, not the name.
    """

    scale: float
    """multiplies ``q . k`` to give the scaled scores ``z``"""
    score: str = "softmax"
    """the score function ``phi`` (a name in ``ssa_flash.scores.SCORES``): logits ``phi(z) + mask``"""
    causal: bool = False
    """key ``j`` is visible to query ``i`` iff ``j <= i`` (top-left alignment)"""
    group: int = 1
    """query heads per key/value head (GQA); 1 without GQA"""
    adaptive: bool = False
    """adaptive temperature: weights ``softmax(beta * l)`` with a per-row ``beta`` from the entropy"""
    poly: Tuple[float, ...] = DEFAULT_POLY
    """the temperature polynomial of the entropy, highest degree first"""
    threshold: float = DEFAULT_THRESHOLD
    """the temperature is 1 on rows whose entropy is at most this"""
    deterministic: bool = False
    """bitwise reproducible forward and backward: the same inputs give the same bits across calls,
    processes and ranks on the same GPU model and software versions. The CUDA backend then runs
    its backward without floating-point atomics (its default fused backward accumulates dQ with
    float32 atomics, whose order varies from run to run); the Triton backend takes a fixed block
    configuration per kernel (the first that builds) instead of the fastest one timed in this
    process or read from the tuning cache (its kernels use no atomics either way); both reduce
    db/dn as per-block partial sums in a fixed order. False: a backend may use atomics and timed
    choices."""
    cu_seqlens_q: Optional[Tensor] = field(default=None, compare=False)
    """packed variable-length batch: int32 ``(batch + 1,)`` offsets of each sequence's query rows
    (tensors are then ``(total, H, D)``, see the module docstring); None: dense"""
    cu_seqlens_k: Optional[Tensor] = field(default=None, compare=False)
    """packed variable-length batch: int32 ``(batch + 1,)`` offsets of each sequence's key rows"""
    max_seqlen_q: int = 0
    """packed variable-length batch: at least the longest sequence's query count (sizes the grid)"""
    max_seqlen_k: int = 0
    """packed variable-length batch: at least the longest sequence's key count"""
    seqused_k: Optional[Tensor] = field(default=None, compare=False)
    """KV cache: int32 ``(B,)``, batch element ``b`` attends key rows below ``seqused_k[b]`` only, with
    bottom-right causality; forward only. None: every key row"""
    k_start: Optional[Tensor] = field(default=None, compare=False)
    """KV cache: int32 ``(B,)`` first key row attended per batch element (left padding); None: 0"""
    num_splits: int = 0
    """KV cache: programs sharing each query block's keys (split-KV); 0: the backend decides"""
    dropout_p: float = 0.0
    """dropout probability in [0, 1] on the final weights (docs/design.md §1.5); 0: no dropout"""
    window_left: int = NO_WINDOW
    """local attention: query ``i`` sees keys ``j >= i - window_left``; -1: unbounded"""
    window_right: int = NO_WINDOW
    """... and keys ``j <= i + window_right``; -1: unbounded (top-left alignment, like ``causal``)"""
    dropout_rng: Optional[Tensor] = dataclasses.field(default=None, compare=False)
    """with ``dropout_p > 0``: the int64 ``(2,)`` tensor ``(seed, offset)`` keying the Philox
    dropout bits (``ssa_flash.reference.dropout_keep_mask`` defines the mask), on the inputs'
    device. A tensor rather than two ints so that drawing it needs no host synchronisation, a
    CUDA graph replays the draw (fresh bits every replay), and torch.compile traces the draw as
    a random op instead of baking one seed into the graph."""
    softcap: float = 0.0
    """logit soft-capping (docs/design.md §1.6): the scaled score ``z`` becomes
    ``softcap * tanh(z / softcap)`` before the logit transform, masks are added after; 0: off"""

    def __post_init__(self):
        # the score function ``score`` names, resolved once per spec (None for an unknown name,
        # which the backends' ``supports`` reports): what the backends and launchers take
        object.__setattr__(self, "score_fn", scores.SCORES.get(self.score))
        if self.poly is not DEFAULT_POLY:  # the default is a tuple of floats already
            object.__setattr__(self, "poly", tuple(float(c) for c in self.poly))

    @property
    def packed(self) -> bool:
        """A packed variable-length batch (``varlen_attention``)."""
        return self.cu_seqlens_q is not None

    @property
    def kv_cache(self) -> bool:
        """Per-batch key lengths of a KV cache (``attention_with_kvcache``): forward only."""
        return self.seqused_k is not None

    @classmethod
    def schema(cls) -> str:
        """The fields as the trailing arguments of an op schema, e.g. ``"float scale, bool causal, ..."``."""
        hints = typing.get_type_hints(cls)
        return ", ".join(f"{_SCHEMA_TYPES[hints[f.name]]} {f.name}" for f in dataclasses.fields(cls))

    def op_args(self) -> tuple:
        """The field values in schema order, as the ops take them (tuples as lists)."""
        return tuple([list(v) if type(v) is tuple else v for v in (getattr(self, name) for name in _FIELD_NAMES)])

    @classmethod
    def from_op_args(cls, args: Sequence) -> "AttentionSpec":
        """Inverse of :meth:`op_args`."""
        return cls(*args)

    @property
    def window(self) -> bool:
        """Whether a window bounds either side."""
        return self.window_left >= 0 or self.window_right >= 0


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(AttentionSpec))

TENSOR_FIELDS = tuple(i for i, (f, t) in enumerate(
    (f, typing.get_type_hints(AttentionSpec)[f.name]) for f in dataclasses.fields(AttentionSpec))
    if t == Optional[Tensor])
"""Positions, in :meth:`AttentionSpec.op_args`, of the tensor-valued fields."""


class TemperatureState(NamedTuple):
    """Per-row tensors ``(B, Hq, Lq)`` of the adaptive temperature, kept for the backward."""

    beta: Tensor  # the temperature applied to the row
    lse_l: Tensor  # log-sum-exp of the temperature-free row l
    entropy: Tensor  # H = entropy of softmax(l)
    dbeta_dh: Tensor  # d beta / d H where the temperature is active, else 0


@runtime_checkable
class Backend(Protocol):
    """The functions of a backend module (shapes and dtypes: this module's docstring).

    The adaptive temperature is two passes with a host step between them, done once for every
    backend by the caller (``ssa_flash.autograd``): ``row_entropy`` gives each row's entropy,
    ``ssa_flash.backends.beta_from_entropy`` turns it into ``beta``, ``forward`` applies it.
    A caller holding only part of the keys (ring attention) can merge the per-shard statistics
    before computing ``beta``, and merge the per-shard ``(out, lse)`` after ``forward``.

    Optional (not a member of the protocol, so a backend without it is still one; the caller asks
    with ``getattr``): ``prepare(q, k, v, mask, params, sinks, spec) -> Optional[PreparedCall]``,
    called after a call with these arguments ran: a :class:`PreparedCall` for later calls whose
    tensors have the same metadata (shape, strides, dtype, device, 16-byte alignment) and whose
    spec equals ``spec`` but for its tensors, or None (not prepared: the caller keeps calling
    ``row_entropy`` / ``forward`` / ``backward``).
    """

    NAME: str

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        """None if the backend can run tensors on ``device`` in this process, else why not (a
        sentence). Cheap: compiles and launches nothing, never raises."""

    def supports(self, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec,
                 sinks: Optional[Tensor] = None) -> Optional[str]:
        """None if the backend runs these inputs (dtype, head dims, sizes, the spec's features,
        ``sinks`` if not None), else why not. Reads shapes, dtypes and the device only (no
        synchronisation)."""

    def row_entropy(self, q: Tensor, k: Tensor, mask: Optional[Tensor], params: Tuple[Tensor, ...],
                    sinks: Optional[Tensor], spec: AttentionSpec) -> Tuple[Tensor, Tensor]:
        """``(entropy, lse_l)`` of each row of ``P = softmax(l)``, ``l = phi(z) + mask`` (with the
        sink appended if ``sinks`` is given): natural-log entropy (0 for a row with no admissible
        entry) and log-sum-exp (-inf for such a row)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], params: Tuple[Tensor, ...],
                sinks: Optional[Tensor], beta: Optional[Tensor], spec: AttentionSpec) -> Tuple[Tensor, Tensor]:
        """``(out (B, Hq, Lq, Dv), lse)``: ``out = softmax(beta * l) @ v`` (``beta`` is None, i.e. 1,
        unless ``spec.adaptive``; with ``sinks`` the softmax is over ``beta * [l, s_h]`` and the
        sink's zero value vector drops out) and the natural-log LSE of that row. Rows with no
        admissible entry: out 0, lse -inf."""

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 dlse: Optional[Tensor], mask: Optional[Tensor], params: Tuple[Tensor, ...],
                 sinks: Optional[Tensor], temp: Optional[TemperatureState], spec: AttentionSpec,
                 mask_grad_shape: Optional[Tuple[int, ...]] = None
                 ) -> Tuple[Tensor, Tensor, Tensor, Tuple[Tensor, ...], Optional[Tensor]]:
        """``(dq, dk, dv, dparams, dsinks)`` given the output gradient ``dout`` and the LSE gradient
        ``dlse`` (or None): docs/design.md §1.2 and §1.3, with ``delta = rowsum(dout * out) - dlse``.
        ``out`` and ``lse`` are those ``forward`` returned (for a key shard: the global ones).
        ``dparams``: one ``(Hq,)`` tensor in the accumulation dtype per parameter (``()`` for
        softmax), ``dparam_h = sum_{b,i,j} dl_ij * dphi/dparam (z_ij)`` over head ``h``'s rows; ``dsinks``
        ``(Hq,)`` in the accumulation dtype (``sum_{b,i} dl_{i,sink}``, docs/maths.md §6), None
        without sinks; ``temp`` is given iff ``spec.adaptive``. ``mask_grad_shape`` (a learned
        float mask, 4-D, dims 1 where it broadcasts): a sixth result, the mask's gradient of that
        shape; a backend that cannot compute it raises ``ValueError``."""


class PreparedCall(Protocol):
    """A backend's work on one specialisation done once (``Backend.prepare``): what is left per
    call is allocating the outputs and launching. ``state`` is what ``forward`` returns for its
    ``backward`` (the extension it ran on, or None)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], params: Tuple[Tensor, ...],
                spec: AttentionSpec) -> Tuple[Tensor, Tensor, Optional[TemperatureState], object]:
        """``(out, lse, temp, state)``: ``row_entropy``, the temperature and ``forward`` of the
        call (``temp`` None unless ``spec.adaptive``). Raises :class:`PlanMismatch`, having
        launched nothing, where this call is not one the preparation holds."""

    def backward(self, state, dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                 out: Tensor, lse: Tensor, mask: Optional[Tensor], params: Tuple[Tensor, ...],
                 temp: Optional[TemperatureState], spec: AttentionSpec):
        """``Backend.backward``'s ``(dq, dk, dv, dparams, None)``."""


class PlanMismatch(Exception):
    """A prepared call (or plan) does not hold this call: a global switch it depends on changed,
    or a tensor is aligned otherwise. The caller takes the full path."""


@runtime_checkable
class KeyShardTemperature(Protocol):
    """Optional functions of a backend module: the adaptive temperature's backward over a shard of
    the keys (``spec.adaptive`` only; tensors as in :meth:`Backend.backward`).

    docs/design.md §1.3: ``g_i = dbeta_i * dbeta/dH_i`` with ``dbeta_i = sum_j dS'_ij l_ij`` over the
    whole row, and every ``dl_ij`` needs ``g_i``. :meth:`Backend.backward` computes ``dbeta`` over
    the keys it is given, which for a key shard is only part of the sum. A caller holding key
    shards sums :meth:`row_dbeta` over them, adds ``temp.lse_l * dlse`` once per row (where a
    gradient reaches the LSE), forms ``g``, and calls :meth:`backward_given_g` on each shard.
    ``out``, ``lse`` and ``temp`` are always those of whole rows (all keys).

    These functions take no ``sinks``: a sink belongs to the whole row, not to a shard of its
    keys, so a caller holding key shards adds its terms once per row itself
    (``ssa_flash.distributed.partial``: ``sink_stats``, ``add_sink``, ``sink_backward``).
    """

    def row_dbeta(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  dlse: Optional[Tensor], mask: Optional[Tensor], params: Tuple[Tensor, ...],
                  temp: TemperatureState, spec: AttentionSpec) -> Tensor:
        """``(B, Hq, Lq)``: ``sum_j dS'_ij (l_ij - lse^l_i)`` over the keys given (``l`` the
        temperature-free logit row, ``lse^l = temp.lse_l`` its whole row's LSE, ``dS' = P' *
        (dout . v_j - delta_i)`` with ``P'`` from the whole row's ``lse``); 0 on rows with no
        admissible key among them. Centred, since ``sum_j dS'_ij = dlse_i`` over the whole row,
        ``dbeta_i`` is the sum over the shards plus ``lse^l_i dlse_i``, without the cancellation of
        terms the size of the logits (docs/maths.md)."""

    def backward_given_g(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                         lse: Tensor, dlse: Optional[Tensor], mask: Optional[Tensor],
                         params: Tuple[Tensor, ...], temp: TemperatureState, g: Tensor,
                         spec: AttentionSpec) -> Tuple[Tensor, Tensor, Tensor, Tuple[Tensor, ...]]:
        """:meth:`Backend.backward` with the temperature gradient ``g (B, Hq, Lq)`` (accumulation
        dtype) given instead of computed from the keys given: the shard's ``(dq, dk, dv, dparams)``
        contributions, which sum over the shards to the whole backward's."""
