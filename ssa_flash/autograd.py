"""The ``torch.library`` custom ops over every backend, and their one autograd formula.

Three operators, each opaque to ``torch.compile`` (Dynamo records a call and never traces into a
backend) and each with a fake (meta) implementation that only computes output shapes. ``SPEC`` is
the fields of :class:`~ssa_flash.spec.AttentionSpec`, generated from it (today
``float scale, str score, bool causal, int group, bool adaptive, float[] poly, float threshold,
bool deterministic, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k,
Tensor? seqused_k, Tensor? k_start, int num_splits, float dropout_p, int window_left, int window_right,
Tensor? dropout_rng, float softcap``)::

    ssa_flash::attn_fwd(Tensor q, Tensor k, Tensor v, Tensor[] score_params, Tensor? sinks,
                        Tensor? mask, str backend, SPEC)
        -> (Tensor out, Tensor lse, Tensor beta, Tensor lse_l, Tensor entropy, Tensor dbeta_dh)
    ssa_flash::attn_bwd(Tensor? dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out,
                        Tensor lse, Tensor[] score_params, Tensor? sinks, Tensor? mask,
                        Tensor? beta, Tensor? lse_l, Tensor? entropy, Tensor? dbeta_dh,
                        bool mask_grad, str backend, SPEC)
        -> (Tensor dq, Tensor dk, Tensor dv, Tensor[] dscore_params, Tensor dsinks, Tensor dmask)
    ssa_flash::row_entropy(Tensor q, Tensor k, Tensor[] score_params, Tensor? sinks, Tensor? mask,
                           str backend, SPEC) -> (Tensor entropy, Tensor lse_l)

``score_params`` are the per-head parameters of the score function ``spec.score``
(``ssa_flash.scores``: ``[]`` for softmax, ``[b, n]`` for SSA, ``[s]`` for the logit scale), each
``(Hq,)`` in the accumulation dtype; the gradients come back as one list of the same length, so a
new score function needs no new op argument. ``sinks`` (``(Hq,)`` in the accumulation dtype, or
None) may require grad too, so it is an argument of the ops rather than a spec field
(docs/design.md §1.6).

``backend`` ("triton", "cuda" or "reference") is an argument of the ops rather than a part of
their names: one schema, one fake implementation and one autograd formula serve every backend, so
they cannot drift apart, and a new backend needs no registration. Under ``torch.compile`` it is a
constant of the graph like ``causal``. (Separate ops per backend would only buy profiler names;
a backend shows in a trace through its kernels' names anyway.)

``attn_fwd`` returns the adaptive temperature's per-row ``(B, Hq, Lq)`` statistics (see
``spec.TemperatureState``) after ``out`` and ``lse``; without adaptive temperature they are empty
``(0,)`` placeholders (a custom-op schema cannot return None). They are not differentiable and
not returned to users. The temperature's host step (``beta`` from the entropy, between the
statistics pass and the flash pass) is done here, once for all backends. ``attn_bwd`` returns
one ``(Hq,)`` gradient per score parameter, ``dsinks`` ``(Hq,)`` with sinks and empty ``(0,)``
without; ``dout`` or ``dlse`` may be None (an unused output).

``attn_fwd``'s autograd formula (``register_autograd``) saves the inputs, ``out``, ``lse``, the
statistics and the spec's tensors (``cu_seqlens_q``/``_k``, a KV cache's ``seqused_k``/``k_start``, the
dropout ``(seed, offset)``: the backward regenerates the same mask from it), and calls ``attn_bwd``; it accepts a gradient for ``lse`` (``return_lse=True``
users may differentiate through it). The mask arrives as an expanded (stride-0) view of the
user's mask and is passed on as is, never materialised; a learned mask (a float mask that
requires grad) arrives as a 4-D tensor of its own size, expanded inside ``attn_fwd`` /
``attn_bwd``, and ``attn_bwd(mask_grad=True)`` returns its gradient ``dmask`` of that size (the
backend reduces it over the broadcast dims; ``(0,)`` otherwise).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

from .backends import cuda_backend
from .backends import beta_from_entropy
from .backends import get as get_backend
from .spec import TENSOR_FIELDS, AttentionSpec, TemperatureState, acc_dtype

__all__ = ["attention", "row_entropy", "SPEC_SCHEMA"]

SPEC_SCHEMA = AttentionSpec.schema()
_N_SPEC = len(dataclasses.fields(AttentionSpec))


def _empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    return like.new_empty((0,), dtype=dtype)


# --------------------------------------------------------------------------------------------
# Forward


def _forward(q, k, v, params, sinks, mask, backend: str, spec: AttentionSpec):
    """``(out, lse, temp)``: ``temp`` the adaptive temperature's :class:`TemperatureState`, or None."""
    be = get_backend(backend)
    if spec.adaptive:
        ent, lse_l = be.row_entropy(q, k, mask, params, sinks, spec)
        beta, dbeta_dh = beta_from_entropy(ent, spec.poly, spec.threshold)
        out, lse = be.forward(q, k, v, mask, params, sinks, beta, spec)
        return out, lse, TemperatureState(beta, lse_l, ent, dbeta_dh)
    out, lse = be.forward(q, k, v, mask, params, sinks, None, spec)
    return out, lse, None


def _full_mask(mask, q, k):
    """A dense call's mask as the backends take it: expanded to ``(B, Hq, Lq, Lk)`` (a view; a
    learned mask reaches the ops as a 4-D tensor of its own size, dims of 1 where it broadcasts)."""
    if mask is None or q.dim() != 4:
        return mask
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return mask if tuple(mask.shape) == full else mask.expand(full)


def _attn_fwd(q, k, v, score_params, sinks, mask, backend, *spec_args):
    out, lse, temp = _forward(q, k, v, tuple(score_params), sinks, _full_mask(mask, q, k), backend,
                              AttentionSpec.from_op_args(spec_args))
    if temp is not None:
        return out, lse, temp.beta, temp.lse_l, temp.entropy, temp.dbeta_dh
    return (out, lse, *(_empty(q, lse.dtype) for _ in range(4)))


def _row_shape(q, spec: AttentionSpec):
    """Shape of a per-row statistic: ``(B, Hq, Lq)``, or ``(Hq, total_q)`` for a packed batch."""
    if spec.packed:
        return (q.shape[1], q.shape[0])
    return tuple(q.shape[:-1])


def _attn_fwd_fake(q, k, v, score_params, sinks, mask, backend, *spec_args):
    spec = AttentionSpec.from_op_args(spec_args)
    acc = acc_dtype(q.dtype)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(_row_shape(q, spec), dtype=acc)
    stat_shape = _row_shape(q, spec) if spec.adaptive else (0,)
    return (out, lse, *(q.new_empty(stat_shape, dtype=acc) for _ in range(4)))


attn_fwd = torch.library.custom_op(
    "ssa_flash::attn_fwd", _attn_fwd, mutates_args=(),
    schema=(f"(Tensor q, Tensor k, Tensor v, Tensor[] score_params, Tensor? sinks, Tensor? mask, str backend, "
            f"{SPEC_SCHEMA}) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
attn_fwd.register_fake(_attn_fwd_fake)


# --------------------------------------------------------------------------------------------
# Backward


def _backward_impl(dout, dlse, q, k, v, out, lse, params, sinks, mask, temp: Optional[TemperatureState],
                   backend: str, spec: AttentionSpec):
    """``(dq, dk, dv, dparams, dsinks)`` through ``backend``; dsinks None without sinks."""
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    if dlse is not None:
        dlse = dlse.contiguous()
    return get_backend(backend).backward(dout, q, k, v, out, lse, dlse, mask, params, sinks, temp, spec)


def _learned_mask_backward(dout, dlse, q, k, v, out, lse, params, sinks, mask, temp, backend: str,
                           spec: AttentionSpec):
    """``(dq, dk, dv, dparams, dsinks, dmask)`` for a learned ``mask`` (4-D, its own size): the
    backend's backward with ``mask_grad_shape``, ``dmask`` in the mask's dtype."""
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    dq, dk, dv, dparams, dsinks, dmask = get_backend(backend).backward(
        dout, q, k, v, out, lse, None if dlse is None else dlse.contiguous(), _full_mask(mask, q, k), params, sinks,
        temp, spec, mask_grad_shape=tuple(mask.shape))
    return dq, dk, dv, dparams, dsinks, dmask.to(mask.dtype)


def _attn_bwd(dout, dlse, q, k, v, out, lse, score_params, sinks, mask, beta, lse_l, entropy, dbeta_dh, mask_grad,
              backend, *spec_args):
    spec = AttentionSpec.from_op_args(spec_args)
    temp = TemperatureState(beta, lse_l, entropy, dbeta_dh) if spec.adaptive else None
    if mask_grad:  # a learned mask: its gradient of its own shape, reduced inside the backend's kernels
        dq, dk, dv, dparams, dsinks, dmask = _learned_mask_backward(dout, dlse, q, k, v, out, lse,
                                                                    tuple(score_params), sinks, mask, temp,
                                                                    backend, spec)
    else:
        dq, dk, dv, dparams, dsinks = _backward_impl(dout, dlse, q, k, v, out, lse, tuple(score_params), sinks,
                                                     _full_mask(mask, q, k), temp, backend, spec)
        dmask = _empty(q, lse.dtype)
    if dsinks is None:
        dsinks = _empty(q, lse.dtype)
    return dq, dk, dv, list(dparams), dsinks, dmask


def _attn_bwd_fake(dout, dlse, q, k, v, out, lse, score_params, sinks, mask, beta, lse_l, entropy, dbeta_dh,
                   mask_grad, backend, *spec_args):
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    heads = q.shape[1]  # Hq: dim 1 of dense and packed layouts
    sink_heads = heads if sinks is not None else 0
    dmask = mask.new_empty(mask.shape) if mask_grad else q.new_empty((0,), dtype=lse.dtype)
    return (dq, dk, dv, [q.new_empty((heads,), dtype=lse.dtype) for _ in score_params],
            q.new_empty((sink_heads,), dtype=lse.dtype), dmask)


attn_bwd = torch.library.custom_op(
    "ssa_flash::attn_bwd", _attn_bwd, mutates_args=(),
    schema=("(Tensor? dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "Tensor[] score_params, Tensor? sinks, Tensor? mask, Tensor? beta, Tensor? lse_l, Tensor? entropy, "
            f"Tensor? dbeta_dh, bool mask_grad, str backend, {SPEC_SCHEMA}) "
            "-> (Tensor, Tensor, Tensor, Tensor[], Tensor, Tensor)"))
attn_bwd.register_fake(_attn_bwd_fake)


# --------------------------------------------------------------------------------------------
# Autograd: the custom op's formula (torch.compile, direct callers of torch.ops.ssa_flash) and the
# eager path's autograd.Function, both over the same implementations (_forward, _backward_impl)


def _setup_context(ctx, inputs, output):
    q, k, v, params, sinks, mask, backend, *spec_args = inputs
    out, lse, beta, lse_l, ent, dbeta_dh = output
    ctx.mark_non_differentiable(beta, lse_l, ent, dbeta_dh)
    ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
    # tensor-valued spec fields go through save_for_backward, the rest are plain attributes
    ctx.backend, ctx.n_params, ctx.has_sinks = backend, len(params), sinks is not None
    ctx.mask_grad = mask is not None and mask.requires_grad  # a learned mask (ops passed it unexpanded)
    ctx.spec_args = tuple(None if i in TENSOR_FIELDS else a for i, a in enumerate(spec_args))
    # a CPU emulation of the CUDA kernels (tests) must serve the backward too, wherever it runs
    ctx.emulator = cuda_backend.active_emulator() if backend == "cuda" else None
    ctx.save_for_backward(q, k, v, out, lse, sinks, mask, beta, lse_l, ent, dbeta_dh,
                          *(spec_args[i] for i in TENSOR_FIELDS), *params)


def _backward(ctx, dout, dlse, *_stat_grads):
    n_inputs = 7 + _N_SPEC
    if dout is None and dlse is None:
        return (None, None, None, [None] * ctx.n_params) + (None,) * (n_inputs - 4)
    q, k, v, out, lse, sinks, mask, beta, lse_l, ent, dbeta_dh, *rest = ctx.saved_tensors
    spec_tensors, params = rest[:len(TENSOR_FIELDS)], rest[len(TENSOR_FIELDS):]
    spec_args = list(ctx.spec_args)
    for i, t in zip(TENSOR_FIELDS, spec_tensors):
        spec_args[i] = t
    spec = AttentionSpec.from_op_args(spec_args)
    if spec.kv_cache:
        raise RuntimeError("ssa_flash: attention over a KV cache (attention_with_kvcache) is forward only")
    if not spec.adaptive:
        beta = lse_l = ent = dbeta_dh = None
    with cuda_backend.emulated(ctx.emulator):
        dq, dk, dv, dparams, dsinks, dmask = torch.ops.ssa_flash.attn_bwd(
            dout, dlse, q, k, v, out, lse, params, sinks, mask, beta, lse_l, ent, dbeta_dh, ctx.mask_grad,
            ctx.backend, *spec_args)
    if not ctx.has_sinks:
        dsinks = None
    return (dq, dk, dv, list(dparams), dsinks, dmask if ctx.mask_grad else None) + (None,) * (n_inputs - 6)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager path (no torch.compile tracing, no dispatch mode): the custom ops' forward and
    backward implementations called directly, with the spec as one object. A custom op's Python
    dispatch and its generated autograd wrapper cost ~20 us and ~200 us of host time per call
    (CPU, torch 2.13), more than all the rest of a call; this ``autograd.Function`` ~10 us. The
    formula is the ops' (:func:`_backward_impl`)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, backend, spec, *params):
        out, lse, temp = _forward(q, k, v, params, sinks, mask, backend, spec)
        ctx.set_materialize_grads(False)
        ctx.backend, ctx.spec, ctx.temp = backend, spec, temp  # not outputs: no reference cycle
        ctx.emulator = cuda_backend.active_emulator() if backend == "cuda" else None
        ctx.save_for_backward(q, k, v, out, lse, sinks, mask, *params)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks, mask, *params = ctx.saved_tensors
        if dout is None and dlse is None:
            return (None,) * (7 + len(params))
        if ctx.spec.kv_cache:
            raise RuntimeError("ssa_flash: attention over a KV cache (attention_with_kvcache) is forward only")
        with cuda_backend.emulated(ctx.emulator):
            dq, dk, dv, dparams, dsinks = _backward_impl(dout, dlse, q, k, v, out, lse, tuple(params), sinks, mask,
                                                         ctx.temp, ctx.backend, ctx.spec)
        return (dq, dk, dv, dsinks, None, None, None, *dparams)


# The backends whose backward computes a learned mask's gradient (``mask_grad_shape``): Triton and
# CUDA C++ reduce it over the broadcast dims inside a kernel, the reference backend in its explicit
# backward
LEARNED_MASK_BACKENDS = ("triton", "cuda", "reference")


class _LearnedMaskAttention(torch.autograd.Function):
    """The eager path for a float mask that requires grad (a learned bias), Triton or CUDA C++
    or reference backend (:data:`LEARNED_MASK_BACKENDS`): as
    :class:`_EagerAttention`, with ``mask`` the user's mask as a 4-D view of its own size (dims 1
    where it broadcasts), expanded here, outside the autograd graph, to ``(B, Hq, Lq, Lk)``; its
    gradient comes back of the 4-D shape, reduced over the broadcast dims inside the kernels
    (``ssa_flash/triton/mask_grad.py``, ``csrc/mask_grad.h``), never materialised as ``(B, Hq, Lq, Lk)``."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, backend, spec, *params):
        out, lse, temp = _forward(q, k, v, params, sinks, _full_mask(mask, q, k), backend, spec)
        ctx.set_materialize_grads(False)
        ctx.backend, ctx.spec, ctx.temp = backend, spec, temp
        ctx.save_for_backward(q, k, v, out, lse, sinks, mask, *params)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks, mask, *params = ctx.saved_tensors
        if dout is None and dlse is None:
            return (None,) * (7 + len(params))
        dq, dk, dv, dparams, dsinks, dmask = _learned_mask_backward(dout, dlse, q, k, v, out, lse, tuple(params),
                                                                    sinks, mask, ctx.temp, ctx.backend, ctx.spec)
        return (dq, dk, dv, dsinks, dmask, None, None, *dparams)


def attention_learned_mask(q: Tensor, k: Tensor, v: Tensor, params: Tuple[Tensor, ...], mask: Tensor, backend: str,
                           spec: AttentionSpec, sinks: Optional[Tensor] = None):
    """:func:`attention` for a float ``mask`` that requires grad, given as a 4-D tensor that
    broadcasts to ``(B, Hq, Lq, Lk)`` (not expanded): differentiable in the mask too, eager or
    through the custom ops (torch.compile, dispatch modes); the backends of
    :data:`LEARNED_MASK_BACKENDS` only."""
    if backend not in LEARNED_MASK_BACKENDS:
        raise ValueError(f"attn_mask requires grad: the {backend!r} backend does not compute gradients with "
                         "respect to attn_mask; backend='triton', 'cuda' or 'reference' does (docs/support.md)")
    if _through_ops(q, k, v, mask):
        # torch.compile, dispatch modes, subclasses: the custom ops, the mask unexpanded (attn_fwd
        # expands it; attn_bwd returns its gradient of its own shape)
        out, lse, *_ = torch.ops.ssa_flash.attn_fwd(q, k, v, list(params), sinks, mask, backend, *spec.op_args())
        return out, lse
    return _LearnedMaskAttention.apply(q, k, v, sinks, mask, backend, spec, *params)


class _PreparedAttention(torch.autograd.Function):
    """The eager path of a call a backend prepared (``spec.Backend.prepare``): as
    :class:`_EagerAttention`, with the non-tensor arguments in one ``call`` tuple ``(prepared,
    spec, mask)`` (each argument of ``apply`` costs a Python step of its own) and no sinks."""

    @staticmethod
    def forward(ctx, call, q, k, v, *params):
        prepared, spec, mask = call
        out, lse, temp, state = prepared.forward(q, k, v, mask, params, spec)
        ctx.set_materialize_grads(False)
        ctx.call, ctx.temp, ctx.state = call, temp, state
        ctx.save_for_backward(q, k, v, out, lse, mask, *params)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if torch.is_grad_enabled():  # create_graph=True: once_differentiable's refusal of a second order
            return _prepared_backward_once(ctx, dout, dlse)
        return _prepared_backward(ctx, dout, dlse)


def _prepared_backward(ctx, dout, dlse):
    q, k, v, out, lse, mask, *params = ctx.saved_tensors
    if dout is None and dlse is None:
        return (None,) * (4 + len(params))
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    if dlse is not None:
        dlse = dlse.contiguous()
    prepared, spec, _ = ctx.call
    dq, dk, dv, dparams, _ = prepared.backward(ctx.state, dout, dlse, q, k, v, out, lse, mask, tuple(params),
                                               ctx.temp, spec)
    return (None, dq, dk, dv, *dparams)


_prepared_backward_once = torch.autograd.function.once_differentiable(_prepared_backward)


def attention_prepared(prepared, q: Tensor, k: Tensor, v: Tensor, params: Tuple[Tensor, ...],
                       mask: Optional[Tensor], backend: str, spec: AttentionSpec):
    """:func:`attention` through ``prepared``, ``backend``'s ``prepare`` of an earlier call whose
    tensors had this call's metadata (eager, plain tensors, no sinks). ``prepared.forward`` may
    raise the backend's ``Unprepared`` before launching anything: the caller then takes
    :func:`attention`."""
    if torch.autograd._profiler_enabled() or _forward_ad._current_level >= 0:
        return attention(q, k, v, params, mask, backend, spec)
    if torch.is_grad_enabled() and _any_requires_grad(q, k, v, None, params):
        return _PreparedAttention.apply((prepared, spec, mask), q, k, v, *params)
    out, lse, _, _ = prepared.forward(q, k, v, mask, params, spec)
    return out, lse


def _through_ops(*tensors) -> bool:
    """Whether a call must go through the custom ops: while torch.compile traces, under a
    dispatch mode (FakeTensorMode, FlopCounterMode, ...), or for tensor subclasses; elsewhere
    the eager path calls the backends directly."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return True
    return any(type(t) is not Tensor for t in tensors)


# --------------------------------------------------------------------------------------------
# Row statistics (not differentiable)


def _row_entropy(q, k, score_params, sinks, mask, backend, *spec_args):
    spec = AttentionSpec.from_op_args(spec_args)
    ent, lse_l = get_backend(backend).row_entropy(q, k, mask, tuple(score_params), sinks, spec)
    return ent, lse_l


def _row_entropy_fake(q, k, score_params, sinks, mask, backend, *spec_args):
    shape = _row_shape(q, AttentionSpec.from_op_args(spec_args))
    acc = acc_dtype(q.dtype)
    return q.new_empty(shape, dtype=acc), q.new_empty(shape, dtype=acc)


row_entropy_op = torch.library.custom_op(
    "ssa_flash::row_entropy", _row_entropy, mutates_args=(),
    schema=(f"(Tensor q, Tensor k, Tensor[] score_params, Tensor? sinks, Tensor? mask, str backend, {SPEC_SCHEMA}) "
            "-> (Tensor, Tensor)"))
row_entropy_op.register_fake(_row_entropy_fake)


# --------------------------------------------------------------------------------------------
# Entry points used by ssa_flash.ops


def attention(q: Tensor, k: Tensor, v: Tensor, params: Tuple[Tensor, ...],
              mask: Optional[Tensor], backend: str, spec: AttentionSpec, sinks: Optional[Tensor] = None):
    """``(out, lse)`` through ``backend``'s kernels, differentiable in q, k, v, the score
    parameters, sinks (and through ``lse``). Tensors as in ``ssa_flash.spec``: q ``(B, Hq,
    Lq, D)``, k ``(B, Hkv, Lk, D)``, v ``(B, Hkv, Lk, Dv)``; ``params`` the score function's
    ``(Hq,)`` parameters in the accumulation dtype (``()`` for softmax); sinks ``(Hq,)`` in the accumulation dtype or None; mask None or expanded to
    ``(B, Hq, Lq, Lk)``. Returns out ``(B, Hq, Lq, Dv)`` in q's dtype and
    lse ``(B, Hq, Lq)`` in the accumulation dtype. A packed batch (``spec.packed``): q, k, v
    ``(total, H, D)``, out ``(total_q, Hq, Dv)``, lse ``(Hq, total_q)``. A KV cache
    (``spec.kv_cache``): forward only (a backward raises)."""
    if _through_ops(q, k, v):
        out, lse, *_ = torch.ops.ssa_flash.attn_fwd(q, k, v, list(params), sinks, mask, backend, *spec.op_args())
        return out, lse
    if torch.autograd._profiler_enabled():  # a name for the call in profiles, as the op would have
        with torch.profiler.record_function("ssa_flash::attention"):
            return _eager(q, k, v, params, mask, backend, spec, sinks)
    return _eager(q, k, v, params, mask, backend, spec, sinks)


def _eager(q, k, v, params, mask, backend: str, spec: AttentionSpec, sinks):
    # (inside forward-mode AD's dual_level the Function stays: it says it has no forward-mode
    # formula, where the bare forward would drop the tangents silently)
    if (torch.is_grad_enabled() and _any_requires_grad(q, k, v, sinks, params)) or _forward_ad._current_level >= 0:
        return _EagerAttention.apply(q, k, v, sinks, mask, backend, spec, *params)
    # nothing to differentiate (inference, eval, torch.no_grad): the forward without the
    # autograd.Function around it (~7 us of host time per call on the CPU)
    out, lse, _ = _forward(q, k, v, params, sinks, mask, backend, spec)
    return out, lse


def _any_requires_grad(q, k, v, sinks, params) -> bool:
    if q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad):
        return True
    for p in params:
        if p.requires_grad:
            return True
    return False


def row_entropy(q: Tensor, k: Tensor, params: Tuple[Tensor, ...],
                mask: Optional[Tensor], backend: str, spec: AttentionSpec,
                sinks: Optional[Tensor] = None) -> Tensor:
    """Entropy ``(B, Hq, Lq)`` of each row's weights ``softmax(l)`` (no temperature; with
    ``sinks`` the row ``[l, s_h]``, sink included), through ``backend``; not differentiable."""
    if _through_ops(q, k):
        ent, _ = torch.ops.ssa_flash.row_entropy(q, k, list(params), sinks, mask, backend, *spec.op_args())
    else:
        ent, _ = get_backend(backend).row_entropy(q, k, mask, params, sinks, spec)
    return ent
