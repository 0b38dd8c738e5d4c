"""Compiling a recorded Triton launch for a GPU target on a machine without a GPU, and the
NVIDIA tools that read the result.

The launch goes through the kernel's own ``JITFunction.warmup`` (the path of a real launch:
argument specialisation, option parsing, compilation), with Triton's driver replaced by a stand-in
that reports the target. Meta tensors have ``data_ptr() == 0``, so pointers are specialised as
16-byte aligned and unit strides as constants, as in a real launch of contiguous tensors.

Everything that depends on Triton's internals is in :func:`_triton_compile`; it handles Triton
3.0 to 3.9, and the kernels need 3.4 (tuple arguments need 3.3; 3.3.1 cannot compile the dK/dV
kernel with dropout), compiled in CI with 3.4.0, 3.6.0 and 3.9.0. Tuple arguments are specialised element by element as scalars are (an element equal to
1 a constant, a multiple of 16 known divisible: ``specialize_impl`` in 3.3's ``runtime/jit.py``,
``native_specialize_impl`` in 3.6 and 3.9), by Triton itself, since the audit launches through
``warmup``. The ptxas log (warnings, spills) is captured from Triton where it can print
it (``TRITON_DUMP_PTXAS_LOG``, Triton >= 3.4); otherwise ptxas is run again on the PTX with the same
target (:func:`ptxas_log`).
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import triton


@dataclass
class Compiled:
    """What the audit needs of one compiled kernel."""

    name: str  # kernel symbol
    cubin: bytes
    ptx: str
    ttir: str
    shared_bytes: int  # dynamic shared memory the launch requests
    num_warps: int
    ptxas_log: str
    ptxas_log_source: str  # "triton" (captured) or "rerun" (ptxas run again on the PTX)
    compile_s: float


def tool_dir() -> str:
    """Directory of the CUDA tools bundled with the imported Triton."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def tool(name: str) -> str:
    """Path of ``ptxas`` / ``cuobjdump`` / ``nvdisasm``: Triton's bundled copy, else ``PATH``."""
    path = os.path.join(tool_dir(), name)
    if os.access(path, os.X_OK):
        return path
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found (neither bundled with Triton in {tool_dir()} nor on PATH)")
    return found


def gpu_name(arch: int) -> str:
    """ptxas's ``--gpu-name`` for ``arch`` as Triton picks it (the ``a`` variants from sm_90 on)."""
    return f"sm_{arch}{'a' if arch >= 90 else ''}"


class _TargetOnlyDriver:
    """Stands in for Triton's CUDA driver while compiling: reports the target, launches nothing."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.device = f"ssa_flash-audit-sm{arch}"  # a cache key of the JIT, distinct from real devices

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def __getattr__(self, name):
        raise AttributeError(f"the audit's stand-in driver cannot {name!r} (nothing runs on a GPU here)")


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _triton_compile(kernel, args, constexprs: dict, num_warps: int, num_stages: int, arch: int):
    """Version-specific glue: compile ``kernel`` as ``kernel[grid](*args, **constexprs, num_warps=,
    num_stages=)`` would on a GPU of compute capability ``arch``. Returns ``(CompiledKernel, log)``,
    ``log`` being ptxas's output when this Triton prints it, else ``""``."""
    from triton.runtime import driver as driver_config

    fake = _TargetOnlyDriver(arch)
    # Where the active driver lives: DriverConfig._active (Triton >= 3.2) or .active (3.0, 3.1).
    slot = "_active" if "_active" in vars(driver_config) else "active"
    previous = vars(driver_config).get(slot)
    for cache_attr in ("device_caches", "cache"):  # the JIT's in-memory caches (3.2+ / 3.0-3.1)
        cache = getattr(kernel, cache_attr, None)
        if isinstance(cache, dict):
            cache.pop(fake.device, None)
    out = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="ssa_flash_audit_") as cache_dir, \
            _env(TRITON_ALWAYS_COMPILE="1", TRITON_DUMP_PTXAS_LOG="1", TRITON_CACHE_DIR=cache_dir), \
            warnings.catch_warnings(), contextlib.redirect_stdout(out):
        # Triton 3.9 warns that its FP-fusion default will change; the audit keeps the default
        # (what a real launch does) and only silences the message.
        warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
        setattr(driver_config, slot, fake)
        try:
            ck = kernel.warmup(*args, grid=(1,), **constexprs, num_warps=num_warps, num_stages=num_stages)
        finally:
            setattr(driver_config, slot, previous)
    log = out.getvalue()
    return ck, (log if "ptxas" in log else "")


def ptxas_log(ptx: str, arch: int, fmad: bool = True) -> str:
    """``ptxas -v`` output for ``ptx`` (the fallback when Triton does not show its own)."""
    with tempfile.TemporaryDirectory(prefix="ssa_flash_audit_") as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [tool("ptxas"), "-lineinfo", "-v", f"--gpu-name={gpu_name(arch)}", src, "-o", os.path.join(d, "k.cubin")]
        if not fmad:
            cmd.insert(1, "--fmad=false")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        return proc.stdout + proc.stderr


def compile_launch(kl, arch: int) -> Compiled:
    """Compile a :class:`ssa_flash.triton.launch.KernelLaunch` for ``sm_<arch>``."""
    start = time.monotonic()
    ck, log = _triton_compile(kl.kernel, kl.args, kl.constexprs, kl.blocks.warps, kl.blocks.stages, arch)
    elapsed = time.monotonic() - start
    md = ck.metadata
    source = "triton"
    if not log:
        fmad = getattr(md, "enable_fp_fusion", True)
        log = ptxas_log(ck.asm["ptx"], arch, fmad=bool(fmad))
        source = "rerun"
    return Compiled(name=md.name, cubin=ck.asm["cubin"], ptx=ck.asm["ptx"], ttir=ck.asm["ttir"],
                    shared_bytes=int(md.shared), num_warps=int(md.num_warps), ptxas_log=log,
                    ptxas_log_source=source, compile_s=elapsed)


def disassemble(cubin: bytes) -> str:
    """``nvdisasm -c -g`` of a cubin (code with source-line annotations)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([tool("nvdisasm"), "-c", "-g", f.name], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvdisasm failed: {proc.stderr.strip()}")
        return proc.stdout


def res_usage(cubin: bytes) -> str:
    """``cuobjdump -res-usage`` of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"cuobjdump failed: {proc.stderr.strip()}")
        return proc.stdout


def triton_version() -> str:
    return triton.__version__


def kernel_source_key(kernel) -> Optional[str]:
    """Triton's hash of a kernel's source and of the jit functions it calls."""
    try:
        return str(kernel.cache_key)
    except Exception:  # noqa: BLE001 - any failure: no key, no caching
        return None
