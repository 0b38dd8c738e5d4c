"""Launch plans: a later call of a kernel launch site with the same shapes, strides, dtypes,
alignments and switches replays the launch its first call worked out, instead of working it out
again.

A call of :func:`ssa_flash.triton.launch.forward` (or ``backward``) derives, from its inputs,
the constexprs, the block configuration, the grid and some 40 runtime arguments, of which only
the tensors change from one training step to the next; on a GPU host the Python steps of that
derivation cost more than the kernels of a short sequence. A :class:`Plan` keeps, per
specialisation (the key a launch site computes from everything but its tensors' data), each
launch's compiled kernel, grid and argument template; a call then fills the template's tensor
slots and launches (``direct.launch_kept``).

A plan is only made where the launch went through the direct launcher with a kept compiled
kernel (``direct.Launcher.kept``): not under the interpreter, not while ``capture_launches``
records, not under a torch dispatch mode, not with direct launches off. Plans are per process
and dropped with the launcher's kept kernels (:func:`clear`).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from . import direct

HITS = [0]  # plan replays in this process (tests read it)

MAX_PLANS = 4096

_plans: Dict[tuple, "Plan"] = {}

GENERATION = [0]
"""How many times the plans were cleared: what holds a :class:`Plan` beyond a lookup
(``prepared.py``) holds it for one generation."""


def clear() -> None:
    """Forget every plan (with ``direct.LAUNCHER.clear``: tests, stub mode's exit)."""
    _plans.clear()
    GENERATION[0] += 1


direct.ON_CLEAR.append(clear)


def get(key) -> Optional["Plan"]:
    plan = _plans.get(key)
    if plan is not None:
        HITS[0] += 1
    return plan


def peek(key) -> Optional["Plan"]:
    """:func:`get` without counting a replay."""
    return _plans.get(key)


def put(key, plan: "Plan") -> None:
    if len(_plans) >= MAX_PLANS:  # shapes that keep changing: start again
        clear()
    _plans[key] = plan


def tensor_key(t: Optional[torch.Tensor]):
    """What a compiled kernel and its launch depend on in a tensor argument: shape, strides,
    dtype and 16-byte alignment (Triton specialises pointers on it)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.data_ptr() & 15)


# Tests set this: plans also under the interpreter, each launch replayed through ``kernel[grid]``
# (the interpreter keeps no compiled kernel), so that what a plan fills in is checked numerically
# on a machine without a GPU.
UNDER_INTERPRETER = False


def usable(device: torch.device) -> bool:
    """Whether launches on ``device`` may be planned now (see the module docstring)."""
    if direct.stub_arch() is not None or UNDER_INTERPRETER:
        return True
    return device.type == "cuda" and direct.enabled() and not torch._C._len_torch_dispatch_stack()


class Launch:
    """One kernel launch of a plan: ``kept`` (``direct.Launcher.kept``), ``grid``, and the
    runtime arguments as a template whose tensor slots ``slots`` (positions, in the order the
    plan's caller passes the tensors) are filled per call. ``via_triton``: ``(kernel, constexprs
    and options)`` launched through ``kernel[grid]`` instead (:data:`UNDER_INTERPRETER`)."""

    __slots__ = ("kept", "grid", "template", "slots", "via_triton")

    def __init__(self, kept: Optional[tuple], grid: tuple, template: Sequence, slots: Tuple[int, ...],
                 via_triton: Optional[tuple] = None):
        self.kept, self.grid, self.template, self.slots = kept, grid, list(template), slots
        self.via_triton = via_triton

    def run(self, device: torch.device, tensors: Sequence) -> None:
        args = self.template.copy()
        for i, t in zip(self.slots, tensors):
            args[i] = t
        if self.via_triton is not None:
            kernel, consts = self.via_triton
            kernel[self.grid](*args, **consts)
        else:
            direct.launch_kept(self.kept, self.grid, args, device)


def make_launch(kernel, grid: tuple, args: tuple, consts: dict, options: dict, device: torch.device,
                slots: Tuple[int, ...]) -> Optional[Launch]:
    """The :class:`Launch` replaying ``kernel[grid](*args, **consts, **options)`` just launched,
    or None when the direct launcher kept no compiled kernel for it (and the interpreter's
    replay is off)."""
    kept = direct.LAUNCHER.kept(kernel, args, consts, options, device)
    if kept is not None:
        return Launch(kept, grid, args, slots)
    if UNDER_INTERPRETER and device.type != "cuda" and direct.stub_arch() is None:
        return Launch(None, grid, args, slots, (kernel, dict(consts, **options)))
    return None


def on_device(device: torch.device):
    """True when ``device`` is the current CUDA device (or no CUDA device is involved): the plan
    can launch without entering it (``block_choice.on_device``'s context costs microseconds)."""
    return device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device()


class Plan:
    """What a launch site keeps for one specialisation: its :class:`Launch` es and whatever the
    site needs to allocate its outputs (``extra``)."""

    __slots__ = ("launches", "extra")

    def __init__(self, launches: Sequence[Launch], extra=None):
        self.launches, self.extra = tuple(launches), extra
