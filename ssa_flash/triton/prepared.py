"""Prepared calls: one specialisation's launch plans held together, so that a repeated call goes
from the public function to its launches without working out any launch key again.

``launch.py``'s entry points key each launch site's plan (``plans.py``) on its tensors' metadata,
the spec and the launcher's switches, a dozen Python steps per launch. A caller that already keys
the whole call (``ssa_flash.ops``' call plans: every argument's type and value, each tensor's
shape, strides, dtype, device and 16-byte alignment) asks :func:`prepare` once, after a first call
made the plans, for a :class:`PreparedCall` holding the row-entropy, temperature and forward
launches; a later call with the same key runs them directly, and its backward keeps one more
plan per gradient layout (``dout``'s and ``dlse``'s metadata). The launcher's global switches are
read once per call (:func:`switches`): when one changes (a plan cleared, direct launches turned
off, TF32, a forced polynomial, ``capture_launches``) the prepared call says so and the caller
takes the full path. Dense layouts without sinks only (what ``launch.py`` plans).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import temperature as _definition
from ..spec import AttentionSpec, PlanMismatch, TemperatureState
from . import block_choice, direct, kernel_args, launch, plans
from .interpreter import environ_get
from .logits import MAX_PARAMS

__all__ = ["PreparedCall", "prepare", "switches"]


def switches() -> tuple:
    """The launcher's global state that launch plans depend on besides their keys' tensors."""
    return (direct._stub_arch, plans.UNDER_INTERPRETER, plans.GENERATION[0], direct.enabled(),
            block_choice.recording is None, kernel_args.tf32_allowed(), kernel_args.FORCE_POLY_EXP2,
            environ_get("SSA_FLASH_POLY_EXP2"))


class PreparedCall:
    """The launches of one specialisation (``spec.PreparedCall``; see the module docstring).
    ``forward`` and ``backward`` take the tensors of a call whose key matched the one
    :func:`prepare` saw; once the launcher's switches changed, ``forward`` raises
    ``PlanMismatch`` and ``backward`` takes ``launch.backward``'s full path."""

    __slots__ = ("switches", "spec", "adaptive", "ent", "temperature", "fwd", "params", "param_align", "bwd")

    def _kernel_params(self, params, q) -> tuple:
        """``(P0, P1)`` as ``launch.kernel_params`` gives them (``q`` for an absent one)."""
        if len(params) != len(self.params):
            raise PlanMismatch
        for given, prepared, align in zip(params, self.params, self.param_align):
            # not the call plan's constant parameters: aligned as those the plans were made with?
            if given is not prepared and given.data_ptr() & 15 != align:
                raise PlanMismatch
        return (*params, q, q)[:MAX_PARAMS]

    def forward(self, q, k, v, mask, params, spec: AttentionSpec):
        """``(out, lse, temp, None)``: ``ssa_flash.autograd``'s forward's results and the state
        :meth:`backward` takes (none here)."""
        if switches() != self.switches:
            raise PlanMismatch
        kp = self._kernel_params(params, q)
        if plans.on_device(q.device):
            return self._launch(q, k, v, mask, kp, spec)
        with block_choice.on_device(q.device):
            return self._launch(q, k, v, mask, kp, spec)

    def _launch(self, q, k, v, mask, kp, spec: AttentionSpec):
        pmask = q if mask is None else (mask.view(torch.uint8) if mask.dtype == torch.bool else mask)
        dev = q.device
        temp = None
        beta = q
        if self.adaptive:
            shape, dtype, _ = self.ent.extra
            ent = torch.empty(shape, device=dev, dtype=dtype)
            lse_l = torch.empty(shape, device=dev, dtype=dtype)
            self.ent.launches[0].run(dev, (q, k, ent, lse_l, kp, pmask, (q, q, q)))
            if self.temperature is None:  # where the full path computes it by its torch definition
                beta, dbeta = _definition.beta_from_entropy(ent, spec.poly, spec.threshold)
            else:
                beta, dbeta = torch.empty_like(ent), torch.empty_like(ent)
                self.temperature.run(dev, (ent, beta, dbeta))  # (fresh tensors: aligned as the plan's were)
            temp = TemperatureState(beta, lse_l, ent, dbeta)
        plans.HITS[0] += 2 if self.adaptive else 1  # (the plans replayed: as plans.get counts them)
        o_shape, lse_shape, lse_dtype, _, drop_rest, ws = self.fwd.extra
        if ws:
            block_choice.ensure_allocator()
        o = torch.empty(o_shape, device=dev, dtype=q.dtype)
        lse = torch.empty(lse_shape, device=dev, dtype=lse_dtype)
        self.fwd.launches[0].run(dev, (q, k, v, o, lse, beta, kp, pmask, (q, q, q),
                                       None if drop_rest is None else (spec.dropout_rng, *drop_rest)))
        return o, lse, temp, None

    def backward(self, state, dout, dlse, q, k, v, out, lse, mask, params, temp, spec: AttentionSpec):
        """``(dq, dk, dv, dparams, None)`` (no sinks here)."""
        key = (dout.shape, dout.stride(), dout.dtype, dout.data_ptr() & 15,
               None if dlse is None else (dlse.shape, dlse.stride(), dlse.dtype, dlse.data_ptr() & 15),
               out.data_ptr() & 15, lse.data_ptr() & 15)
        plan = self.bwd.get(key)
        if plan is not None and switches() != self.switches:
            self.bwd.clear()
            plan = None
        if plan is None:
            res = launch.backward(dout, q, k, v, out, lse, dlse, mask, params, temp, spec)
            plan = plans.peek(launch._bwd_plan_key(dout, q, k, v, out, lse, dlse, mask, params, temp, spec, None,
                                                  None))
            if plan is not None and len(self.bwd) < 16:
                self.bwd[key] = plan
            return res
        plans.HITS[0] += 1
        return launch._bwd_replay(plan, dout, q, k, v, out, lse, dlse, mask, params, temp, spec)


def prepare(q, k, v, mask, params, spec: AttentionSpec, temperature_launch=None) -> Optional[PreparedCall]:
    """The :class:`PreparedCall` of a dense call without sinks that ran just now (so its plans
    exist), or None where a launch was not planned. ``temperature_launch``: the adaptive
    temperature's :class:`plans.Launch` (entropy, beta, dbeta), or None where the full path
    computes the temperature by its torch definition (``ssa_flash.temperature``)."""
    if launch._unaligned(None, q, v):
        return None
    call = PreparedCall()
    call.switches, call.spec, call.adaptive = switches(), spec, spec.adaptive
    call.params, call.param_align = params, tuple(p.data_ptr() & 15 for p in params)
    launch.kernel_params(spec.score_fn, params, q)  # (a wrong count raises here, as on the full path)
    call.ent = call.temperature = None
    beta = None
    if spec.adaptive:
        key = launch._dense_key(q, k, k, mask, params, spec, None, None)
        call.ent = None if key is None else plans.peek(("row_entropy", key))
        if call.ent is None:
            return None
        shape, dtype, _ = call.ent.extra
        beta = torch.empty(shape, device=q.device, dtype=dtype)  # (its key as the temperature's output's)
        call.temperature = temperature_launch
    key = launch._fwd_plan_key(q, k, v, mask, params, beta, spec, None, None)
    call.fwd = None if key is None else plans.peek(key)
    if call.fwd is None:
        return None
    call.bwd = {}
    return call
