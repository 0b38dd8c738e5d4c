"""Triton's CPU interpreter without two costs that buy nothing: the test session's only change to it.

1. The language mapping at every helper call. The interpreter maps ``triton.language``'s builtins
   onto its numpy implementations when a kernel launch starts (``_patch_lang``, undone when the
   launch ends), and again at *every call of a ``@triton.jit`` helper* inside the kernel, in every
   program and loop iteration. Again finds the language already mapped: it rescans the modules
   (``inspect.getmembers`` of ``triton.language``, its ``tensor`` class and ``math``) and replaces
   wrappers with equivalent ones, which changes nothing but costs about a millisecond per helper
   call. While a launch runs, a helper whose module names only language modules the launch has
   already mapped now skips it (a helper naming another one, e.g. ``triton.language.standard``'s
   naming ``core``, still maps it, as before); the launch's restore is unchanged.
2. The integer-overflow computation. The interpreter redoes every 32-bit integer add, subtract and
   multiply in 64 bits and builds a range condition for ``device_assert``, which does nothing
   unless the interpreter's ``debug`` option is set (it is not: ``InterpreterOptions`` default,
   and no environment variable sets it); so the work is dropped by turning its
   ``sanitize_overflow`` option off when ``debug`` is off. No check is lost.

Measured (Triton 3.9, one core): a packed-batch dropout test (tests/ops/test_varlen.py, the
Philox, mask and loop helpers called thousands of times) 30.2 s -> 19.0 s with the first, 12.9 s
with both. :func:`install` changes nothing when this Triton's interpreter lacks the names it
patches (another version): the tests then run at the interpreter's own speed.
"""
from __future__ import annotations

import dataclasses
import functools


def install() -> bool:
    """Applies both changes to the imported Triton's interpreter; whether it could (idempotent)."""
    try:
        from triton.runtime import interpreter
        import triton.language as tl
    except ImportError:
        return False
    patch, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if patch is None or executor is None or options is None or not dataclasses.is_dataclass(options):
        return False
    if getattr(options, "debug", True) is False and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    if getattr(patch, "_ssa_flash_skips_nested", False):
        return True

    languages = (tl, tl.core)
    state = {"mapped": None}  # ids of the language modules the running launch mapped; None outside one
    seen = {}  # id(a module's globals) -> ids of the language modules it names

    def languages_of(fn):
        key = id(fn.__globals__)
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in languages))
        return seen[key]

    @functools.wraps(patch)
    def patch_once_per_launch(fn):
        mapped, wanted = state["mapped"], languages_of(fn)
        if mapped is not None and wanted <= mapped:
            return None  # a helper's call: already mapped (the interpreter drops a helper call's value)
        if mapped is not None:
            mapped |= wanted
        return patch(fn)

    patch_once_per_launch._ssa_flash_skips_nested = True
    launch = executor.__call__

    @functools.wraps(launch)
    def run_launch(self, *args, **kwargs):
        outer = state["mapped"]
        state["mapped"] = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["mapped"] = outer

    interpreter._patch_lang = patch_once_per_launch
    executor.__call__ = run_launch
    return True
