"""Launching compiled Triton kernels without Triton's generic launch path.

``kernel[grid](*args, **constexprs)`` binds every argument through Triton's generic binder on
each call: ~40 arguments and nested tuples for the attention kernels, tens of microseconds of
host time per launch. The first such call returns the ``CompiledKernel``; :class:`Launcher`
keeps it per specialisation and launches it again with ``CompiledKernel.run``, the call that
Triton's ``JITFunction.run`` itself ends with (the same in Triton 3.4 to 3.9: grid, stream,
function handle, packed metadata, launch metadata and the launch hooks, then every argument of
the signature in order, constexprs included; tests/triton/test_direct_launch_binding.py checks the
arguments against what Triton's own binder hands over, for 3.4, 3.6 and 3.9).

A compiled kernel is only valid for arguments with the properties Triton specialised it on:
each argument's type, integers equal to 1 (compiled in as constants), integers divisible by 16,
the integer width (i32 or i64), and pointers' dtypes and 16-byte alignment. :func:`spec_key`
computes a key at least that fine, so a kept kernel is reused only for arguments of the
specialisation it was compiled for; any other call goes through ``kernel[grid]`` and Triton's
own cache, as before. Integers are keyed by value (finer than Triton, cheaper to hash), so a
new shape's first launch goes through Triton too; at most ``MAX_KEPT`` kernels are kept. ``SSA_FLASH_DIRECT_LAUNCH=0`` turns direct launches off (every launch
through ``kernel[grid]``), for comparison.

Stub mode (:func:`stub`): the launcher behaves as on a GPU of a given architecture but each
launch is a no-op, so that the host path's cost can be measured on a machine without a GPU
(``python -m ssa_flash.bench --host``). Outputs are allocated, never written.
"""
from __future__ import annotations

import inspect
import logging
from typing import Optional

import torch

from .interpreter import environ_get

ENV = "SSA_FLASH_DIRECT_LAUNCH"
MAX_KEPT = 4096


_broken: Optional[str] = None  # why a direct launch failed in this process, if one did
logger = logging.getLogger("ssa_flash")


def enabled() -> bool:
    """Whether kept compiled kernels are launched directly (the default; off after a direct launch
    failed in this process)."""
    return _broken is None and environ_get(ENV, "1") not in ("", "0")


class Unspecialisable(Exception):
    """An argument of a type :func:`spec_key` cannot key: that launch goes through Triton."""


_Tensor = torch.Tensor


def _spec(x):
    t = type(x)
    if t is int or t is float or x is None or t is bool:
        return x  # the value itself: finer than Triton's (== 1, % 16, width) and hashed in C
    if t is _Tensor or isinstance(x, _Tensor):
        return (x.dtype, x.data_ptr() & 15 == 0)
    if t is tuple:
        return tuple([_spec(e) for e in x])
    raise Unspecialisable(t)


def _layout(args: tuple) -> tuple:
    """Where the tensors are in ``args``: per argument True (a tensor), None (a value: a number,
    None, or a tuple of them) or, for a tuple holding tensors, the same for its elements. Fixed
    for a kernel and its constexprs (an optional argument is None or a tuple according to its
    switch), so :class:`Launcher` works it out once per specialisation."""
    out = []
    for a in args:
        if isinstance(a, _Tensor):
            out.append(True)
        elif type(a) is tuple:
            inner = _layout(a)
            out.append(inner if any(x is not None for x in inner) else None)
        else:
            _spec(a)  # raises for a type that cannot be keyed
            out.append(None)
    return tuple(out)


def _keyed(args: tuple, layout: tuple) -> tuple:
    """:func:`spec_key` along a :func:`_layout`: values as they are, tensors by dtype and
    alignment. A tensor where the layout has a value raises ``ValueError`` (the caller then
    launches through Triton); tuples of values are taken whole (the layout is fixed by the
    constexprs, see :func:`_layout`)."""
    out = []
    for a, where in zip(args, layout):
        if where is None:
            if isinstance(a, _Tensor):
                raise ValueError("the arguments' layout changed")
            out.append(a)
        elif where is True:
            out.append((a.dtype, a.data_ptr() & 15 == 0))
        else:
            out.append(_keyed(a, where))
    return tuple(out)


def spec_key(args: tuple) -> tuple:
    """A key at least as fine as what Triton specialises a compiled kernel on, for the runtime
    arguments ``args``: tensors by dtype and 16-byte alignment, numbers by value (shapes and
    strides: a new shape is a new key, whose first launch goes through Triton)."""
    return tuple([_spec(a) for a in args])


class _Signature:
    """A JIT function's parameters: the runtime ones must all precede the constexprs (true of
    every kernel here); ``tail(consts)`` gives the constexprs' values in signature order."""

    def __init__(self, kernel):
        fn = getattr(kernel, "fn", kernel)
        params = list(inspect.signature(fn).parameters.values())
        is_const = [p.annotation is not None and "constexpr" in str(p.annotation) for p in params]
        first_const = is_const.index(True) if True in is_const else len(params)
        self.ok = all(is_const[first_const:])
        self.n_runtime = first_const
        self.consts = [(p.name, p.default) for p in params[first_const:]]

    def tail(self, consts: dict) -> tuple:
        return tuple(consts[name] if name in consts else default for name, default in self.consts)


class _StubKernel:
    """Stands in for a compiled kernel in stub mode: launching it does nothing."""

    function = packed_metadata = None

    @staticmethod
    def run(*args):
        return None


_stub_arch: Optional[int] = None

ON_CLEAR: list = []
"""Functions :meth:`Launcher.clear` calls: the caches of kept kernels' uses above this module
(``plans.py`` registers its ``clear``), so this module imports none of them."""


class Launcher:
    """The compiled kernels kept per specialisation, and their direct launch."""

    def __init__(self):
        self._kept: dict = {}
        self._layouts: dict = {}
        self._signatures: dict = {}

    def clear(self) -> None:
        """Forget the kept kernels, and what was made of them (``plans.py``'s launch plans: the
        functions of :data:`ON_CLEAR`)."""
        self._kept.clear()
        self._layouts.clear()
        for forget in ON_CLEAR:
            forget()

    def _signature(self, kernel) -> _Signature:
        sig = self._signatures.get(kernel)
        if sig is None:
            try:
                sig = _Signature(kernel)
            except (TypeError, ValueError):  # no inspectable signature: never launched directly
                sig = _Signature.__new__(_Signature)
                sig.ok = False
            self._signatures[kernel] = sig
        return sig

    def run(self, kernel, grid: tuple, args: tuple, consts: dict, options: dict, device: torch.device):
        """Launch ``kernel`` on ``grid`` with runtime ``args`` (signature order) and constexprs
        ``consts`` (block sizes included), compile ``options`` (``num_warps``, ``num_stages``),
        on ``device``'s current stream (the caller made ``device`` current)."""
        stub = _stub_arch is not None
        if (not (stub or enabled()) or device.type != "cuda" and not stub
                or torch._C._len_torch_dispatch_stack()):  # under a dispatch mode pointers mean nothing
            kernel[grid](*args, **consts, **options)
            return
        # the device too: a compiled kernel's function handle belongs to one device's context
        space = (kernel, device, tuple(consts.items()), tuple(options.items()))
        try:
            layout = self._layouts.get(space)
            if layout is None:
                layout = self._layouts[space] = _layout(args)
            key = (space, _keyed(args, layout))
        except (Unspecialisable, TypeError, ValueError):
            kernel[grid](*args, **consts, **options)
            return
        kept = self._kept.get(key)
        if kept is None:
            if len(self._kept) >= MAX_KEPT:  # shapes that keep changing: start again
                self._kept.clear()
            if stub:
                compiled = _StubKernel
            else:
                compiled = kernel[grid](*args, **consts, **options)
                if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
                    return  # not a CompiledKernel (a test's stand-in): never kept
            sig = self._signature(kernel)
            if not sig.ok:
                return
            self._kept[key] = (compiled, sig.tail(consts))
            if not stub:
                return  # this call launched it
            kept = self._kept[key]
        try:
            launch_kept(kept, grid, args, device)
        except Exception as err:
            if stub:
                raise
            # A Triton whose launch convention differs from the one read in 3.4-3.9: launch through
            # Triton from now on (an error of the launch itself then recurs there and is raised)
            global _broken
            _broken = f"{type(err).__name__}: {err}"
            logger.warning("ssa_flash: direct launches of compiled Triton kernels are off for this process "
                           "(%s); launching through Triton instead", _broken)
            self.clear()
            kernel[grid](*args, **consts, **options)

    def kept(self, kernel, args: tuple, consts: dict, options: dict, device: torch.device):
        """The ``(compiled kernel, constexpr tail)`` that :meth:`run` keeps for these arguments, or
        None (not launched yet, or never launched directly): what a launch plan
        (``launch.py``) launches again with :func:`launch_kept`."""
        space = (kernel, device, tuple(consts.items()), tuple(options.items()))
        layout = self._layouts.get(space)
        if layout is None:
            return None
        try:
            return self._kept.get((space, _keyed(args, layout)))
        except (Unspecialisable, TypeError, ValueError):
            return None


_get_stream = None


def _current_stream(device: torch.device) -> int:
    global _get_stream
    if _get_stream is None:
        from triton.runtime import driver

        _get_stream = driver.active.get_current_stream
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _get_stream(index)


def _hooks():
    """Triton's launch enter / exit hooks, each None when nothing is registered: Triton >= 3.5
    keeps an empty ``HookChain`` there (never None), and a non-None hook makes every launch
    build its launch metadata and call back into Python twice."""
    from triton import knobs

    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return (None if enter is None or getattr(enter, "calls", True) == [] else enter,
            None if leave is None or getattr(leave, "calls", True) == [] else leave)


def launch_kept(kept: tuple, grid: tuple, args: tuple, device: torch.device) -> None:
    """Launch a kept ``(compiled kernel, constexpr tail)`` (:meth:`Launcher.kept`) on ``grid``
    with runtime ``args`` on ``device``'s current stream (the caller made ``device`` current):
    ``CompiledKernel.run`` as ``JITFunction.run`` calls it. In stub mode nothing runs."""
    compiled, tail = kept
    if _stub_arch is not None:
        return
    stream = _current_stream(device)
    enter, leave = _hooks()
    meta = None if enter is None and leave is None else compiled.launch_metadata(grid, stream, *args, *tail)
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, meta, enter, leave, *args, *tail)


LAUNCHER = Launcher()


def stub_arch() -> Optional[int]:
    """The architecture stub mode pretends, or None outside it."""
    return _stub_arch


class stub:
    """Context: launches are no-ops and the launcher plans as on compute capability ``arch``
    (tensors may be CPU tensors). Not re-entrant."""

    def __init__(self, arch: int = 90):
        self.arch = int(arch)

    def __enter__(self):
        global _stub_arch
        if _stub_arch is not None:
            raise RuntimeError("direct.stub is not re-entrant")
        _stub_arch = self.arch
        return self

    def __exit__(self, *exc):
        global _stub_arch
        _stub_arch = None
        LAUNCHER.clear()
        return False
