"""tests/interpreter_speedup.py: the session's changes to Triton's interpreter change no result
and drop no check."""
import os

import pytest
import torch

import interpreter_speedup

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="no interpreter in use")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _scaled(x, factor):
    return x * factor + tl.zeros_like(x)  # zeros_like: a helper of triton.language.standard (names `core`)


@triton.jit
def _helper_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    for _ in range(3):
        x = _scaled(x, 2.0)
    tl.store(out_ptr + offs, tl.maximum(x, 0.0) + tl.sqrt(x * x) - x)


@triton.jit
def _int_mul_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * 65536)


def test_installed_and_helpers_run():
    from triton.runtime import interpreter

    assert interpreter_speedup.install()  # (tests/conftest.py installed it: idempotent)
    assert interpreter._patch_lang._ssa_flash_skips_nested
    x = torch.arange(16, dtype=torch.float32)
    out = torch.empty_like(x)
    for _ in range(2):  # a second launch maps the language again
        _helper_kernel[(1,)](x, out, N=16)
        torch.testing.assert_close(out, x * 8)


def test_overflow_checks_were_not_asserted():
    """With the interpreter's own options (``debug`` off) an int32 overflow wraps, with the overflow
    computation or without it: turning it off drops no check."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    assert builder.options.debug is False and builder.options.sanitize_overflow is False
    x = torch.full((16,), 1 << 20, dtype=torch.int32)
    saved = builder.options
    try:
        for sanitize in (True, False):
            builder.options = dataclasses.replace(saved, sanitize_overflow=sanitize)
            out = torch.empty_like(x)
            _int_mul_kernel[(1,)](x, out, N=16)
            assert torch.equal(out, x * 65536)  # wrapped (0), no assertion
    finally:
        builder.options = saved
