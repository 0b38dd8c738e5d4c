"""The CPU emulation of the CUDA kernels (csrc/emu, built by emu_harness.py beside this file) as a
stand-in for the CUDA extension, so that backend="cuda" (its Python glue, the custom ops,
torch.compile) runs on CPU tensors in tests.

    emu = build_emulator(tmp_path)            # or pytest.skip if the CUDA headers are missing
    with ssa_flash.cuda.emulated(emu):
        ssa_flash.ssa_attention(q, k, v, backend="cuda")   # float16 / bfloat16 CPU tensors

The library is built once per session, in the background (tests/background.py; tests/conftest.py
starts it when a collected module imports ``build_emulator``), and shared: each call returns a
new ``Emulator`` of it.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import background

# head dims the emulator is compiled for (compile time grows with each); others up to 32 are padded
HEAD_DIMS = (32,)


def harness():
    spec = importlib.util.spec_from_file_location("ssa_emu_harness_tests", Path(__file__).resolve().parent / "emu_harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build():
    """(harness module, library path), or (None, why) without the CUDA headers."""
    h = harness()
    if h.cuda_include_dir() is None:
        return None, "CUDA headers (cuda_fp16.h) not found: the CPU emulation cannot be built"
    return h, h.build(background.tmpdir("emulator"), head_dims=HEAD_DIMS)


def build_test_library(source, out_dir, name, defines=()):
    """A test's own emulation entry point (``source``, a .cpp including csrc headers) built with the
    host compiler into ``out_dir / name``, with ``defines`` (``-D`` flags): (library path, None), or
    (None, why) without the CUDA headers or a host compiler; a failed build raises."""
    import os
    import shutil
    import subprocess

    inc = harness().cuda_include_dir()
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if inc is None or cxx is None:
        return None, "CUDA headers (cuda_fp16.h) or a host C++ compiler not found"
    out = Path(out_dir) / name
    csrc = Path(__file__).resolve().parent.parent / "csrc"
    cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wno-attributes", "-U_FORTIFY_SOURCE", "-DSSA_FLASH_EMULATE",
           *defines, "-I", str(csrc), "-I", str(inc), str(source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"emulation build failed:\n{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return out, None


def prebuild():
    background.submit("emulation.emulator", _build)


def _build_hopper():
    """The CUDA backend's emulator for sm_90a holding the sm_90a kernels (``SSA_FLASH_HOPPER_FWD=1``:
    the warp-specialised forward and backward, each behind its run-time switch), head dims 64 and
    128, no soft-capping / sink instances: (library, None) or (None, why)."""
    h = harness()
    if h.cuda_include_dir() is None:
        return None, "CUDA headers (cuda_fp16.h) not found"
    return h.build(background.tmpdir("hopper_backend_emu"), head_dims=(64, 128), sm90=True, extras=False,
                   hopper_fwd=True), None


def hopper_backend_job():
    """The session's build of :func:`_build_hopper` (one, shared by the Hopper forward's and
    backward's tests; a background job: ``.result()``)."""
    return background.submit("emulation.hopper_backend", _build_hopper)


def build_emulator(out_dir=None, **kw):
    """An ``Emulator`` (options ``kw``) of the kernels compiled for ``HEAD_DIMS``; skips the test
    without the CUDA toolkit's headers or a host compiler. ``out_dir``: unused (the library is
    the session's shared build)."""
    h, lib = background.submit("emulation.emulator", _build).result()
    if h is None:
        pytest.skip(lib)
    return h.Emulator(lib, **kw)


def cuda_backend_context():
    """A factory of the context the CUDA backend runs in: the extension on a GPU (skips when it is
    unavailable), else the emulator built for this session. Tests call ``with factory(): ...``."""
    import contextlib

    import ssa_flash
    from attn_testing import CUDA, DEVICE

    if CUDA:
        if not ssa_flash.cuda.is_available():
            pytest.skip(f"CUDA backend unavailable: {ssa_flash.cuda.unavailable_reason(DEVICE)}")
        return contextlib.nullcontext
    emu = build_emulator()
    return lambda: ssa_flash.cuda.emulated(emu)
