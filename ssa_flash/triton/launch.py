"""Host side of the Triton kernels: block sizes, strides, grids, launches.

Tensors arrive already validated (see ``ssa_flash.ops``): ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``,
``v (B, Hkv, Lk, Dv)`` with any strides; ``mask`` is None or a boolean / floating tensor already
expanded (as a view) to ``(B, Hq, Lq, Lk)``; ``params`` is the score function's
(``spec.score``, ``ssa_flash.scores``) tuple of per-head parameters, one contiguous ``(Hq,)`` tensor
in the accumulation dtype per name in its ``params`` (``()`` for softmax; SSA ``(b, n)``, the logit
scale ``(s,)``); the kernels are compiled for ``SCORE = score.id``. Per-row statistics are
contiguous ``(B, Hq, Lq)``. ``spec`` is the backends' one :class:`~ssa_flash.spec.AttentionSpec`
(``spec.softcap`` turns on the kernels' ``SOFTCAP``; the sink logits, an ``(Hq,)`` tensor in the
accumulation dtype, arrive as ``sinks=`` and turn on ``SINKS``; the layout fields reach these
functions as ``layout=`` below).

Two other layouts (``layout=``, see ``extents.py``'s ``VARLEN``):

* :class:`Packed`: a packed variable-length batch, ``q (total_q, Hq, D)``, ``k (total_k, Hkv, D)``,
  ``v (total_k, Hkv, Dv)``, outputs ``(total_q, Hq, Dv)``, per-row statistics ``(Hq, total_q)``;
  forward, statistics and backward. No mask.
* :class:`KVCache`: dense tensors where batch element ``b`` attends only cache rows
  ``[k_start[b], seqused_k[b])`` with bottom-right causality; forward and statistics only, with
  the keys optionally split among several programs per row (:func:`num_splits_heuristic`).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..conventions import dropout_keep_threshold
from ..spec import AttentionSpec, TemperatureState
from . import block_choice, direct, kernel_args, mask_grad, plans, tiles
from .backward import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel
# (the layout types the entry points take, and the audit's capture: where callers find them)
from .block_choice import KernelLaunch, capture_launches  # noqa: F401
from .block_choice import block_consts as _block_consts, compile_options as _options, launch_kernel as _launch
from .block_choice import on_device as _on_device, split_grid as _split_grid, tma_ready as _tma_ready
from .dropout import dropout_mask_kernel
from .extents import VARLEN_NONE, VARLEN_PACKED
from .forward import attention_fwd_kernel
from .interpreter import environ_get
from .kernel_args import PARAMS as _PARAMS, acc_dtype as _acc_dtype, check_offsets as _check_offsets
from .kernel_args import common_consts as _common_consts, feature_args as _feature_args, head_block_of as _head_block
from .kernel_args import logit_args as _logit_args, mask_args as _mask_args, pad_head as _pad_head
from .kernel_args import poly_exp2_degree as _poly_exp2_degree, positional as _positional
from .kernel_args import scale_args as _scale_args, strides_of as _strides, tf32_allowed
from .layouts import KVCache, Packed, num_splits_heuristic  # noqa: F401
from .layouts import check_packed_offsets as _check_packed_offsets, kernel_name as _kernel_name
from .layouts import merge_block_s as _merge_block_s, packed_view as _packed_view, resolve_layout as _resolve_layout
from .layouts import split_count as _splits, stat_for as _stat_for, unaligned as _unaligned
from .logits import kernel_params
from .masks import MASK_ADD, MASK_NONE
from .row_entropy import row_entropy_kernel
from .splitkv import merge_entropy_kernel, merge_output_kernel
from .tiles import Blocks, cdiv as _cdiv



def row_entropy(q, k, mask, params, spec: AttentionSpec, layout=None, sinks=None):
    """Entropy and log-sum-exp of ``softmax(l)`` per row (the sink an entry of the row if
    ``sinks``), each ``(B, Hq, Lq)`` (packed: ``(Hq, total_q)``), O(L) memory. ``params``: the
    score function's per-head parameters (module docstring)."""
    if _unaligned(layout, q):
        return row_entropy(_pad_head(q), _pad_head(k), mask, params, spec, layout, sinks)
    plan_key = _dense_key(q, k, k, mask, params, spec, layout, sinks)
    if plan_key is not None:
        plan_key = ("row_entropy", plan_key)
        plan = plans.get(plan_key)
        if plan is not None:
            return _ent_replay(plan, q, k, mask, params)
    lay = _resolve_layout(q, k, None, layout)
    q4, k4 = lay.q, lay.k
    _, H, _, D = q4.shape
    acc_torch = torch.float64 if q.dtype == torch.float64 else torch.float32
    ent, lse_l = _stat_for(lay, q, H), _stat_for(lay, q, H)
    mask_args, mask_kind = _mask_args(mask, q4)
    score = spec.score_fn
    score_params = kernel_params(score, params, q)  # q: a dummy for absent parameters
    consts = _common_consts(q4, spec, score, mask_kind)
    consts.update(VARLEN=lay.varlen)
    feat_args, feat_consts = _feature_args(q, lay.Lq, lay.Lk, spec)
    consts["WINDOW"] = feat_consts["WINDOW"]  # dropout acts after the statistics
    logit_args, logit_consts = _logit_args(spec, sinks, acc_torch)
    consts.update(logit_consts)
    name = _kernel_name("row_entropy", lay)
    state = {}

    def args(blk):
        splits = _splits(lay, blk.m, blk.n, H, q.device)
        state["splits"] = splits
        ent_out, lse_out = ent, lse_l
        if splits > 1:
            shape = (splits,) + tuple(ent.shape)
            state["parts"] = ent_out, lse_out = (torch.empty(shape, device=q.device, dtype=acc_torch),
                                                 torch.empty(shape, device=q.device, dtype=acc_torch))
        return _positional(
            "row_entropy", Q=q4, K=k4, ENT=ent_out, LSE=lse_out, score_params=score_params, **mask_args,
            q_strides=_strides(q4), k_strides=_strides(k4),
            dims=(H, lay.Lq, lay.Lk, D, spec.group, _cdiv(lay.Lq, blk.m)),
            **_scale_args(spec.scale), seqlens=(lay.cu_q, lay.cu_k, lay.seqused_k),
            stat_stride_h=lay.stat_stride_h, stat_stride_s=ent.numel() if splits > 1 else 0,
            window=feat_args["window"], **logit_args)

    def grid(blk):
        return (_cdiv(lay.Lq, blk.m) * lay.batch * H, _splits(lay, blk.m, blk.n, H, q.device))

    blk = _launch(row_entropy_kernel, name, grid, args, dict(consts, SPLIT=None), q.device, consts["BLOCK_D"],
                  q.dtype, spec.deterministic, (lay.Lq, lay.Lk, lay.batch * H))
    if plan_key is not None and state.get("splits", 1) == 1 and block_choice.recording is None:
        launch = _plan_launch(row_entropy_kernel, "row_entropy", ENT_SLOTS, blk, grid(blk), args(blk),
                              dict(consts, SPLIT=None), q.device)
        if launch is not None:
            plans.put(plan_key, plans.Plan([launch], (tuple(ent.shape), ent.dtype, score)))
    if state.get("splits", 1) > 1 and block_choice.recording is None:
        ent_part, lse_part = state["parts"]
        with _on_device(q.device):
            direct.LAUNCHER.run(merge_entropy_kernel, (ent.numel(),),
                                (ent_part, lse_part, ent, lse_l, state["splits"], ent.numel()),
                                dict(BLOCK_S=_merge_block_s(state["splits"]), ACC=_acc_dtype(q.dtype)), {}, q.device)
    return ent, lse_l


def forward(q, k, v, mask, params, beta, spec: AttentionSpec, layout=None, sinks=None):
    """Output ``(B, Hq, Lq, Dv)`` in q's dtype and natural-log LSE ``(B, Hq, Lq)`` of ``beta * l``
    (packed: ``(total_q, Hq, Dv)`` and ``(Hq, total_q)``); with ``sinks`` of ``beta * [l, s_h]``.
    ``params``: the score function's per-head parameters (module docstring)."""
    if _unaligned(layout, q, v):
        o, lse = forward(_pad_head(q), _pad_head(k), _pad_head(v), mask, params, beta, spec, layout, sinks)
        return o[..., :v.shape[-1]].contiguous(), lse
    plan_key = _fwd_plan_key(q, k, v, mask, params, beta, spec, layout, sinks)
    if plan_key is not None:
        plan = plans.get(plan_key)
        if plan is not None:
            return fwd_replay(plan, q, k, v, mask, params, beta, spec)
    lay = _resolve_layout(q, k, v, layout)
    q4, k4, v4 = lay.q, lay.k, lay.v
    _, H, _, D = q4.shape
    DV = v4.shape[3]
    acc_torch = torch.float64 if q.dtype == torch.float64 else torch.float32
    if lay.varlen == VARLEN_PACKED:
        o = torch.empty((q.shape[0], H, DV), device=q.device, dtype=q.dtype)
        o4 = _packed_view(o)
    else:
        o = o4 = torch.empty((q.shape[0], H, q.shape[2], DV), device=q.device, dtype=q.dtype)
    lse = _stat_for(lay, q, H)
    mask_args, mask_kind = _mask_args(mask, q4)
    score = spec.score_fn
    score_params = kernel_params(score, params, q)
    consts = _common_consts(q4, spec, score, mask_kind, DV)
    consts.update(ADAPTIVE=spec.adaptive, BLOCK_DV=_head_block(DV), VARLEN=lay.varlen,
                  POLY_EXP2=_poly_exp2_degree(q, score, max(consts["BLOCK_D"], _head_block(DV)), "fwd"))
    name = _kernel_name("fwd", lay)
    state = {}
    feat_args, feat_consts = _feature_args(q, lay.Lq, lay.Lk, spec)
    consts.update(feat_consts)
    logit_args, logit_consts = _logit_args(spec, sinks, acc_torch)
    consts.update(logit_consts)

    def args(blk):
        splits = _splits(lay, blk.m, blk.n, H, q.device)
        state["splits"] = splits
        o_out, lse_out, stride_os = o4, lse, 0
        if splits > 1:
            state["parts"] = o_out, lse_out = (
                torch.empty((splits,) + tuple(o.shape), device=q.device, dtype=acc_torch),
                torch.empty((splits,) + tuple(lse.shape), device=q.device, dtype=acc_torch))
            stride_os = o_out.stride(0)
            o_out = o_out.select(0, 0)
        return _positional(
            "fwd", Q=q4, K=k4, V=v4, O=o_out, LSE=lse_out, BETA=beta if spec.adaptive else q,
            score_params=score_params, **mask_args,
            q_strides=_strides(q4), k_strides=_strides(k4), v_strides=_strides(v4), o_strides=_strides(o_out),
            dims=(H, lay.Lq, lay.Lk, D, DV, spec.group, _cdiv(lay.Lq, blk.m)),
            **_scale_args(spec.scale), seqlens=(lay.cu_q, lay.cu_k, lay.seqused_k),
            stat_stride_h=lay.stat_stride_h, split_strides=(stride_os, lse.numel() if splits > 1 else 0),
            **feat_args, **logit_args)

    def grid(blk):
        return (_cdiv(lay.Lq, blk.m) * lay.batch * H, _splits(lay, blk.m, blk.n, H, q.device))

    # the warp-specialised form (WARP_SPECIALIZE) implements dense layouts with D = DV in {64, 128}
    # and 16-bit inputs only, without mask, dropout, window, sinks or cap; it reads beta through a
    # descriptor too, whose rows of each (batch, head) must start 16-byte aligned
    # (the table's answer first: elsewhere than sm_90 nothing more is read on the host path)
    ws_ok = (tiles.warp_specialized_forward(block_choice.device_arch(q.device), consts["BLOCK_D"], q.dtype) is not None
             and lay.varlen == VARLEN_NONE and mask_kind == MASK_NONE and D == DV and D in (64, 128)
             and q.dtype in (torch.float16, torch.bfloat16) and not feat_consts["DROPOUT"]
             and not feat_consts["WINDOW"] and not logit_consts and _tma_ready(q4, k4, v4)
             and (not spec.adaptive or (lay.Lq % 4 == 0 and beta.is_contiguous() and beta.data_ptr() % 16 == 0)))
    if ws_ok:
        # no index checks in the warp-specialised loop where every key block is whole and none is
        # cut by the diagonal (its key tiles are 64 or 128 wide: 128 divides both)
        consts["WS_FULL_BLOCKS"] = not spec.causal and lay.Lk % 128 == 0
    blk = _launch(attention_fwd_kernel, name, grid, args, dict(consts, SPLIT=None), q.device,
                  max(consts["BLOCK_D"], consts["BLOCK_DV"]), q.dtype, spec.deterministic,
                  (lay.Lq, lay.Lk, lay.batch * H), ws_ok)
    splits = state.get("splits", 1)
    if plan_key is not None and splits == 1 and block_choice.recording is None:
        _plan_forward(plan_key, blk, grid, args, dict(consts, SPLIT=None), q, o, lse, mask_args, feat_args)
    if splits > 1 and block_choice.recording is None:
        o_part, lse_part = state["parts"]
        with _on_device(q.device):
            direct.LAUNCHER.run(
                merge_output_kernel, (lse.numel(),),
                (o_part, lse_part, o, lse, tuple(o_part.stride()), tuple(o.stride()), H, lay.Lq, DV, splits, lse.numel()),
                dict(BLOCK_S=_merge_block_s(splits), BLOCK_DV=_head_block(DV), ACC=_acc_dtype(q.dtype)), {}, q.device)
    return o, lse


# Launch plans (plans.py) of the dense forward: the tensors a call passes, by the names of the
# kernel's runtime parameters, in the order a plan's launch fills them
FWD_SLOTS = ("Q", "K", "V", "O", "LSE", "BETA", "score_params", "MASK", "seqlens", "dropout")
ENT_SLOTS = ("Q", "K", "ENT", "LSE", "score_params", "MASK", "seqlens")


def _ent_replay(plan, q, k, mask, params):
    """:func:`row_entropy` from its plan."""
    shape, dtype, score = plan.extra
    ent = torch.empty(shape, device=q.device, dtype=dtype)
    lse_l = torch.empty(shape, device=q.device, dtype=dtype)
    _run_plan(plan, q.device, (q, k, ent, lse_l, kernel_params(score, params, q), _planned_mask(mask, q), (q, q, q)))
    return ent, lse_l


def _planned_mask(mask, q):
    """The ``MASK`` argument of a planned launch (as :func:`_mask_args` gives it)."""
    if mask is None:
        return q
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _run_plan(plan, device: torch.device, *tensors) -> None:
    """Run ``plan``'s launches, each with its tuple of ``tensors``, with ``device`` current."""
    if plans.on_device(device):
        for launch, ts in zip(plan.launches, tensors):
            launch.run(device, ts)
    else:
        with _on_device(device):
            for launch, ts in zip(plan.launches, tensors):
                launch.run(device, ts)


def _spec_key(spec: AttentionSpec) -> tuple:
    """The fields of ``spec`` a dense launch depends on (the dropout tensor by its key only)."""
    return (spec.scale, spec.score, spec.causal, spec.group, spec.adaptive, spec.poly, spec.threshold,
            spec.deterministic, spec.dropout_p, spec.window_left, spec.window_right, spec.softcap,
            plans.tensor_key(spec.dropout_rng))


def _fwd_plan_key(q, k, v, mask, params, beta, spec: AttentionSpec, layout, sinks) -> Optional[tuple]:
    """The plan key of a dense forward (see plans.py), or None where the call is not planned."""
    key = _dense_key(q, k, v, mask, params, spec, layout, sinks)
    if key is None:
        return None
    return ("fwd", key, plans.tensor_key(beta) if spec.adaptive else None)


def _dense_key(q, k, v, mask, params, spec: AttentionSpec, layout, sinks) -> Optional[tuple]:
    """What every dense launch's plan key holds (the inputs, the spec, the global switches the
    constexprs read), or None where the call is not planned: a layout, sinks, a boolean mask
    turned additive, parameters that are not tensors, or launches that cannot be planned now
    (:func:`plans.usable`)."""
    if layout is not None or sinks is not None or block_choice.recording is not None or not plans.usable(q.device):
        return None
    if mask is not None and mask.dtype == torch.bool and kernel_args.bool_mask_as_additive(q):
        return None
    try:
        pkey = tuple([plans.tensor_key(p) for p in params])
    except AttributeError:  # a number among the parameters
        return None
    return (plans.tensor_key(q), plans.tensor_key(k), plans.tensor_key(v), q.device, plans.tensor_key(mask), pkey,
            _spec_key(spec),
            q.dtype == torch.float32 and tf32_allowed(), kernel_args.FORCE_POLY_EXP2,
            environ_get("SSA_FLASH_POLY_EXP2") if spec.score == "ssa" else None)


def _plan_launch(kernel, name: str, slots: tuple, blk: Blocks, grid: tuple, args: tuple, consts: dict,
                 device: torch.device):
    """The :class:`plans.Launch` of the launch of ``kernel`` (``_PARAMS`` name ``name``) just made
    in configuration ``blk`` with ``grid``, runtime ``args`` and ``consts`` (as :func:`_run` made
    it), its tensor slots those of the parameters named in ``slots``; None if nothing was kept."""
    grid, kconsts = _split_grid(grid, consts)
    return plans.make_launch(kernel, grid, args, _block_consts(kconsts, blk),
                             _options(blk, block_choice.device_arch(device)), device,
                             tuple(_PARAMS[name].index(n) for n in slots))


def _plan_forward(key, blk, grid_fn, args_fn, consts, q, o, lse, mask_args, feat_args) -> None:
    """Keep the plan of the dense forward launch just made in configuration ``blk``, if the
    direct launcher kept its compiled kernel."""
    launch = _plan_launch(attention_fwd_kernel, "fwd", FWD_SLOTS, blk, grid_fn(blk), args_fn(blk), consts, q.device)
    if launch is None:
        return
    drop = feat_args["dropout"]
    extra = (tuple(o.shape), tuple(lse.shape), lse.dtype, consts["SCORE"], None if drop is None else drop[1:],
             blk.ws)
    plans.put(key, plans.Plan([launch], extra))


def fwd_replay(plan, q, k, v, mask, params, beta, spec: AttentionSpec):
    """:func:`forward` from its plan: allocate the outputs, fill the tensor slots, launch."""
    o_shape, lse_shape, lse_dtype, score, drop_rest, ws = plan.extra
    if ws:  # Triton's allocator is a context variable: the launching thread may not have it yet
        block_choice.ensure_allocator()  # (a checkpointed forward recomputed in the autograd engine's thread)
    o = torch.empty(o_shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(lse_shape, device=q.device, dtype=lse_dtype)
    _run_plan(plan, q.device, (q, k, v, o, lse, beta if spec.adaptive else q, kernel_params(spec.score_fn, params, q),
                               _planned_mask(mask, q), (q, q, q),
                               None if drop_rest is None else (spec.dropout_rng, *drop_rest)))
    return o, lse


def backward(do, q, k, v, o, lse, dlse, mask, params, temp: Optional[TemperatureState],
             spec: AttentionSpec, layout=None, *, g: Optional[torch.Tensor] = None,
             dbeta_only: bool = False, sinks: Optional[torch.Tensor] = None, mask_grad_shape=None):
    """Gradients ``(dq, dk, dv, dparams, dsinks)`` (and ``dmask`` last with ``mask_grad_shape``); ``dparams`` is a tuple with one ``(Hq,)``
    tensor (accumulation dtype) per entry of ``params`` (``()`` for softmax), ``dsinks`` ``(Hq,)``
    or None without ``sinks``.

    ``dlse`` (or None) is the gradient reaching the returned LSE: since ``d lse_i / d S'_ij = P'_ij``
    it only shifts ``delta`` (``delta_i = rowsum(dO_i * O_i) - dlse_i``). ``layout``: None (dense) or
    :class:`Packed`.

    For callers holding a shard of the keys (adaptive only; see :func:`row_dbeta`): ``g``
    ``(B, Hq, Lq)`` is the temperature gradient ``g_i = dbeta_i * dbeta/dH_i`` of whole rows, used
    instead of the one computed from the keys given; ``dbeta_only`` runs the dQ kernel alone and
    returns its ``g`` (``temp.dbeta_dh`` of ones makes that the partial ``dbeta``, centred as
    :func:`row_dbeta` says).

    ``mask_grad_shape``: a learned float mask (dense layout only): the 4-D shape (each dim 1 or the
    full one) of its gradient, computed by ``mask_grad.py``'s kernel after the dQ kernel and
    returned in the accumulation dtype as a sixth result. None (the default): nothing changes.
    """
    if isinstance(layout, KVCache):
        raise NotImplementedError("ssa_flash: the KV-cache layout (decoding) is forward only")
    if _unaligned(layout, q, v):
        res = backward(_pad_head(do), _pad_head(q), _pad_head(k), _pad_head(v), _pad_head(o), lse, dlse, mask,
                       params, temp, spec, layout, g=g, dbeta_only=dbeta_only, sinks=sinks,
                       mask_grad_shape=mask_grad_shape)
        if dbeta_only:
            return res
        dq, dk, dv, dparams, dsinks, *dmask = res
        D, DV = q.shape[-1], v.shape[-1]
        return (dq[..., :D].contiguous(), dk[..., :D].contiguous(), dv[..., :DV].contiguous(), dparams, dsinks,
                *dmask)
    plan_key = None
    if mask_grad_shape is not None:
        _check_mask_grad_layout(layout, mask, g, dbeta_only)
    elif g is None and not dbeta_only:
        plan_key = _bwd_plan_key(do, q, k, v, o, lse, dlse, mask, params, temp, spec, layout, sinks)
        if plan_key is not None:
            plan = plans.get(plan_key)
            if plan is not None:
                return _bwd_replay(plan, do, q, k, v, o, lse, dlse, mask, params, temp, spec)
    lay = _resolve_layout(q, k, v, layout)
    packed = lay.varlen == VARLEN_PACKED
    q4, k4, v4 = lay.q, lay.k, lay.v
    do4, o4 = (_packed_view(do), _packed_view(o)) if packed else (do, o)
    _, H, _, D = q4.shape
    HKV, DV = k4.shape[1], v4.shape[3]
    if packed:
        _check_packed_offsets(do, lay.Lq)
        _check_packed_offsets(o, lay.Lq)
    else:
        _check_offsets(do, o)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    dq4, dk4, dv4 = (_packed_view(dq), _packed_view(dk), _packed_view(dv)) if packed else (dq, dk, dv)
    delta = _stat_for(lay, q, H)
    lse2 = _stat_for(lay, q, H)  # the LSE in base 2, -inf (empty rows) as 0: written by the dQ kernel
    acc_torch = delta.dtype
    mask_args, mask_kind = _mask_args(mask, q4)
    lse_lo = _lse_residuals(lay, q, H, mask_kind, spec.adaptive, lse2)
    score = spec.score_fn
    score_params = kernel_params(score, params, q)
    n_params = len(tuple(params))
    consts = _common_consts(q4, spec, score, mask_kind, DV)
    consts.update(ADAPTIVE=spec.adaptive, BLOCK_DV=_head_block(DV), VARLEN=lay.varlen)
    feat_args, feat_consts = _feature_args(q, lay.Lq, lay.Lk, spec)
    consts.update(feat_consts)
    head_block = max(consts["BLOCK_D"], consts["BLOCK_DV"])
    consts.update(POLY_EXP2=_poly_exp2_degree(q, score, head_block, "bwd_dkdv"))
    logit_args, logit_consts = _logit_args(spec, sinks, acc_torch)
    if spec.adaptive:
        beta, lse_l, ent, dbeta_dh = temp
        g_given = g is not None
        g = _stat_for(lay, q, H) if g is None else g.to(acc_torch).contiguous()
    else:
        g_given = False
        if g is not None or dbeta_only:
            raise ValueError("g and dbeta_only are for the adaptive temperature only")
        beta = lse_l = ent = dbeta_dh = g = q
    common_args = dict(score_params=score_params, **mask_args, q_strides=_strides(q4), k_strides=_strides(k4),
                       v_strides=_strides(v4), do_strides=_strides(do4), **_scale_args(spec.scale),
                       seqlens=(lay.cu_q, lay.cu_k), **feat_args)
    B = lay.batch
    parts = {}

    def dq_args(blk):
        num_m = _cdiv(lay.Lq, blk.m)
        # one partial sum per program and parameter; packed: programs past their sequence's end
        # write none
        alloc = torch.zeros if packed else torch.empty
        parts["dparams"] = [alloc((B * H * num_m,), device=q.device, dtype=acc_torch) for _ in range(n_params)]
        sink_args = None
        if sinks is not None:
            parts["dsinks"] = (torch.zeros if packed else torch.empty)((B * H * num_m,), device=q.device,
                                                                     dtype=acc_torch)
            sink_args = (logit_args["sinks"], parts["dsinks"])
        param_parts = kernel_params(score, parts["dparams"], q)
        return _positional(
            "bwd_dq", Q=q4, K=k4, V=v4, O=o4, DO=do4, DQ=dq4,
            row_stats=(lse, dlse if dlse is not None else q, delta, lse2, *lse_lo, lay.stat_stride_h),
            temperature=(beta, lse_l, ent, dbeta_dh, g),
            param_parts=param_parts, **common_args, o_strides=_strides(o4), dq_strides=_strides(dq4),
            dims=(H, lay.Lq, lay.Lk, D, DV, spec.group, num_m), sinks=sink_args, softcap=logit_args["softcap"])

    dq_consts = dict(consts, **logit_consts, HAS_DLSE=dlse is not None,
                     POLY_EXP2=_poly_exp2_degree(q, score, head_block, "bwd_dq"))
    if g_given:  # only then: the default specialisations' constexprs stay as they were
        dq_consts["G_GIVEN"] = True
    if dbeta_only and dlse is not None:  # a shard's dbeta: the caller adds lse_l * dlse once per row
        dq_consts["DBETA_PART"] = True
    dq_grid = lambda blk: (_cdiv(lay.Lq, blk.m) * B * H,)  # noqa: E731
    dq_blk = _launch(attention_bwd_dq_kernel, "bwd_dq", dq_grid, dq_args,
                     dq_consts, q.device, head_block, q.dtype, spec.deterministic, (lay.Lq, lay.Lk, B * H))
    if dbeta_only:
        return g
    dmask = None
    if mask_grad_shape is not None:  # after the dQ kernel: it reads the row statistics written there
        dmask = mask_grad.mask_grad(
            mask_grad_shape, q4, k4, v4, do4, mask, score_params, (lse2, delta, *lse_lo),
            (beta, lse_l, ent, g), consts, feat_args, feat_consts, logit_args["softcap"], _scale_args(spec.scale),
            spec.group, spec.adaptive, consts["BLOCK_DV"], block_choice.device_arch(q.device))
    dq_planned = None
    if plan_key is not None and block_choice.recording is None:
        launched = dict(parts)  # dq_args allocates new partial sums: keep the launched ones
        dq_planned = (dq_blk, dq_grid(dq_blk), dq_args(dq_blk))
        parts.update(launched)

    def dkdv_args(blk):
        return _positional(
            "bwd_dkdv", Q=q4, K=k4, V=v4, DO=do4, DK=dk4, DV_OUT=dv4, row_stats=(lse2, delta, *lse_lo, lay.stat_stride_h),
            temperature=(beta, lse_l, ent, g), **common_args, dk_strides=_strides(dk4), dv_strides=_strides(dv4),
            dims=(H, HKV, lay.Lq, lay.Lk, D, DV, spec.group, _cdiv(lay.Lk, blk.n)),
            softcap=logit_args["softcap"])

    dkdv_consts = dict(consts)
    if spec.softcap > 0:  # the dK/dV kernel needs no sink (its tiles use the sink-including LSE)
        dkdv_consts["SOFTCAP"] = True
    dkdv_grid = lambda blk: (_cdiv(lay.Lk, blk.n) * B * HKV,)  # noqa: E731
    dkdv_blk = _launch(attention_bwd_dkdv_kernel, "bwd_dkdv", dkdv_grid,
                       dkdv_args, dkdv_consts, q.device, head_block, q.dtype, spec.deterministic,
                       (lay.Lq, lay.Lk, B * H))
    if dq_planned is not None:
        dq_blk, grid, args = dq_planned
        _plan_backward(plan_key, q, (dq_blk, grid, args, dq_consts),
                       (dkdv_blk, dkdv_grid(dkdv_blk), dkdv_args(dkdv_blk), dkdv_consts),
                       (tuple(delta.shape), acc_torch, B * H * _cdiv(lay.Lq, dq_blk.m), n_params, score,
                        None if feat_args["dropout"] is None else feat_args["dropout"][1:], lay.stat_stride_h))
    dsinks = None
    # per-program partial sums added in a fixed order; per query head
    dparams = tuple(part.view(B, H, -1).sum(dim=(0, 2)) for part in parts["dparams"])
    if sinks is not None:
        dsinks = parts["dsinks"].view(B, H, -1).sum(dim=(0, 2))
    if dmask is not None:
        return dq, dk, dv, dparams, dsinks, dmask
    return dq, dk, dv, dparams, dsinks


def _check_mask_grad_layout(layout, mask, g, dbeta_only) -> None:
    """A learned mask's gradient: the dense layout with a float mask, one launch over all the keys."""
    if layout is not None:
        raise ValueError("ssa_flash: a mask that requires grad is supported for the dense layout only")
    if mask is None or not mask.is_floating_point():
        raise ValueError("ssa_flash: mask_grad_shape needs a floating (additive) mask")
    if g is not None or dbeta_only:
        raise ValueError("ssa_flash: a mask that requires grad is not supported over key shards (given g)")


def _lse_residuals(lay: _Layout, q, H: int, mask_kind: int, adaptive: bool, dummy) -> tuple:
    """``(LSE2_LO, LSE_L2_HI, LSE_L2_LO)``, the backward's buffers of the recounted LSEs
    (``lse_residual.py``): per-row statistics with an additive mask (the last two with the
    adaptive temperature only), ``dummy`` otherwise (never read)."""
    if mask_kind != MASK_ADD:
        return dummy, dummy, dummy
    lo = _stat_for(lay, q, H)
    if not adaptive:
        return lo, lo, lo
    return lo, _stat_for(lay, q, H), _stat_for(lay, q, H)


# the tensors a call passes to each backward kernel (plans.py), by their parameters' names
DQ_SLOTS = ("Q", "K", "V", "O", "DO", "DQ", "row_stats", "temperature", "score_params", "param_parts", "MASK",
             "seqlens", "dropout")
DKDV_SLOTS = ("Q", "K", "V", "DO", "DK", "DV_OUT", "row_stats", "temperature", "score_params", "MASK", "seqlens",
               "dropout")


def _bwd_plan_key(do, q, k, v, o, lse, dlse, mask, params, temp, spec: AttentionSpec, layout, sinks):
    """The plan key of a dense backward (as :func:`_fwd_plan_key`), or None."""
    key = _dense_key(q, k, v, mask, params, spec, layout, sinks)
    if key is None:
        return None
    tk = plans.tensor_key
    return ("bwd", key, tk(do), tk(o), tk(lse), tk(dlse),
            tuple([tk(t) for t in temp]) if spec.adaptive else None)


def _plan_backward(key, q, dq_launch, dkdv_launch, extra) -> None:
    """Keep the plan of the dense backward's two launches just made (``(blk, grid, args,
    constexprs)`` each), if the direct launcher kept both compiled kernels."""
    launches = []
    for kernel, name, slots, (blk, grid, args, consts) in (
            (attention_bwd_dq_kernel, "bwd_dq", DQ_SLOTS, dq_launch),
            (attention_bwd_dkdv_kernel, "bwd_dkdv", DKDV_SLOTS, dkdv_launch)):
        launch = _plan_launch(kernel, name, slots, blk, grid, args, consts, q.device)
        if launch is None:
            return
        launches.append(launch)
    plans.put(key, plans.Plan(launches, extra))


def _bwd_replay(plan, do, q, k, v, o, lse, dlse, mask, params, temp, spec: AttentionSpec):
    """:func:`backward` from its plan (dense, no sinks, no given ``g``)."""
    stat_shape, acc, n_parts, n_params, score, drop_rest, h = plan.extra
    dev = q.device
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    delta = torch.empty(stat_shape, device=dev, dtype=acc)
    lse2 = torch.empty(stat_shape, device=dev, dtype=acc)
    lse_lo = (lse2,) * 3
    if mask is not None and (mask.is_floating_point() or kernel_args.bool_mask_as_additive(q)):  # MASK_ADD: residuals
        lse_lo = tuple(torch.empty(stat_shape, device=dev, dtype=acc) for _ in range(3))
    if spec.adaptive:
        beta, lse_l, ent, dbeta_dh = temp
        g = torch.empty(stat_shape, device=dev, dtype=acc)
    else:
        beta = lse_l = ent = dbeta_dh = g = q
    parts = [torch.empty((n_parts,), device=dev, dtype=acc) for _ in range(n_params)]
    score_params = kernel_params(score, params, q)
    mask = _planned_mask(mask, q)
    dropout = None if drop_rest is None else (spec.dropout_rng, *drop_rest)
    _run_plan(plan, dev,
              (q, k, v, o, do, dq, (lse, q if dlse is None else dlse, delta, lse2, *lse_lo, h),
               (beta, lse_l, ent, dbeta_dh, g),
               score_params, kernel_params(score, parts, q), mask, (q, q), dropout),
              (q, k, v, do, dk, dv, (lse2, delta, *lse_lo, h), (beta, lse_l, ent, g), score_params, mask, (q, q),
               dropout))
    B, H = q.shape[0], q.shape[1]
    dparams = tuple(part.view(B, H, -1).sum(dim=(0, 2)) for part in parts)
    return dq, dk, dv, dparams, None


def row_dbeta(do, q, k, v, o, lse, dlse, mask, params, temp: TemperatureState, spec: AttentionSpec):
    """This shard's centred part of ``dbeta_i``, ``sum_j dS'_ij (l_ij - lse^l_i)`` ``(B, Hq, Lq)``
    over the keys given (adaptive only; the contract of
    :meth:`ssa_flash.spec.KeyShardTemperature.row_dbeta`): ``o``, ``lse`` and ``temp``
    are those of whole rows. One launch of the dQ kernel with ``dbeta/dH = 1`` (its other outputs
    are discarded)."""
    if not spec.adaptive:
        raise ValueError("row_dbeta is for the adaptive temperature only")
    ones = TemperatureState(temp.beta, temp.lse_l, temp.entropy, torch.ones_like(temp.dbeta_dh))
    return backward(do, q, k, v, o, lse, dlse, mask, params, ones, spec, dbeta_only=True)


def dropout_mask(rng: torch.Tensor, shape, dropout_p: float) -> torch.Tensor:
    """The keep-mask ``(B, H, Lq, Lk)`` (bool, on ``rng``'s device) that the attention kernels
    apply for the ``(seed, offset)`` tensor ``rng`` and ``dropout_p``, materialised by a kernel that
    calls the same ``dropout.dropout_keep`` on tiles of its own size. For tests and inspection."""
    B, H, Lq, Lk = (int(x) for x in shape)
    out = torch.empty((B, H, Lq, Lk), device=rng.device, dtype=torch.uint8)
    if out.numel() == 0:
        return out.bool()
    # tiles unlike any attention kernel's (which use 16 x 16 under the interpreter)
    bm, bn = (32, 64) if block_choice.device_arch(rng.device) is None else (64, 128)
    num_m, num_n = _cdiv(Lq, bm), _cdiv(Lk, bn)
    with _on_device(rng.device):
        dropout_mask_kernel[(num_m * num_n * B * H,)](
            out, rng, dropout_keep_threshold(float(dropout_p)), H, Lq, Lk, tuple(out.stride()), num_m, num_n,
            BLOCK_M=bm, BLOCK_N=bn, FAST_MATH=block_choice.device_arch(rng.device) is not None)
    return out.bool()
