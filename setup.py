"""Build script. The pure-Python package always installs; the CUDA extension ``ssa_flash._C``
(csrc/) is added when a CUDA toolkit and a CUDA-enabled torch are importable at build time
(see docs/cuda.md).

Environment:

* ``SSA_FLASH_BUILD_CUDA=1`` builds the extension or fails saying why; ``=0`` never builds it;
  unset: build it when possible, else install the pure-Python package (the CUDA backend then
  JIT-compiles the extension on first use, see ``ssa_flash/cuda.py``).
* ``TORCH_CUDA_ARCH_LIST`` (default ``7.5;8.0;8.6;8.9;9.0``, with ``7.0`` first when the toolkit's
  nvcc still compiles for Volta, i.e. CUDA <= 12.x) and ``MAX_JOBS`` are honoured, as by every
  torch extension build (ninja is used when installed).

torch is needed at build time, so a CUDA build must not run in an isolated build environment:
``pip install --no-build-isolation .`` (an isolated build sees no torch and installs the
pure-Python package, or fails under ``SSA_FLASH_BUILD_CUDA=1``).
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")
# 9.0a: the sm_90a target (wgmma; the dQ kernel's Hopper path), whose code runs on every sm_90 GPU
DEFAULT_ARCHS = "7.5;8.0;8.6;8.9;9.0a"


def csrc_files(patterns=("*.h", "*.cuh", "*.cu", "*.cpp")):
    out = []
    for pattern in patterns:
        out.extend(sorted(glob.glob(os.path.join(CSRC, pattern))))
    return out


class BuildPyWithSources(build_py):
    """Also ships csrc/ inside the package (``ssa_flash/_csrc``) so that an installed pure-Python
    package can JIT-build the extension later."""

    def run(self):
        super().run()
        if self.dry_run:
            return
        dest = os.path.join(self.build_lib, "ssa_flash", "_csrc")
        os.makedirs(dest, exist_ok=True)
        for path in csrc_files():
            shutil.copy2(path, dest)


def cuda_build_decision():
    """(build: bool, reason: str). Raises under SSA_FLASH_BUILD_CUDA=1 when it cannot build."""
    flag = os.environ.get("SSA_FLASH_BUILD_CUDA", "").strip()
    if flag not in ("", "0", "1"):
        raise RuntimeError(f"SSA_FLASH_BUILD_CUDA must be 0 or 1, got {flag!r}")
    if flag == "0":
        return False, "SSA_FLASH_BUILD_CUDA=0"
    why = None
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception as err:  # no torch in the build environment (isolated build?)
        why = (f"torch is not importable at build time ({err}); use pip install --no-build-isolation "
               "with a CUDA-enabled torch installed")
    else:
        if torch.version.cuda is None:
            why = f"torch {torch.__version__} is a CPU-only build"
        elif CUDA_HOME is None:
            why = "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"
        elif not csrc_files(("*.cu",)):
            why = "csrc/ is missing from the source tree"
    if why is None:
        return True, ""
    if flag == "1":
        raise RuntimeError(f"SSA_FLASH_BUILD_CUDA=1 but the CUDA extension cannot be built: {why}")
    return False, why


def nvcc_supports(arch: str, cuda_home) -> bool:
    """Whether the toolkit's nvcc compiles for compute_<arch> (CUDA 13 dropped sm_70)."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError, TypeError):
        return False
    return f"compute_{arch}" in out.split()


def default_archs(cuda_home) -> str:
    return ("7.0;" if nvcc_supports("70", cuda_home) else "") + DEFAULT_ARCHS


def cuda_extension_kwargs():
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = default_archs(CUDA_HOME)
    sources = [os.path.relpath(p, HERE) for p in csrc_files(("*.cu", "*.cpp"))]
    ext = CUDAExtension(
        name="ssa_flash._C",
        sources=sources,
        include_dirs=[CSRC],
        extra_compile_args={
            # torch's BuildExtension adds the C++ standard its headers need (C++17 or newer)
            "cxx": ["-O3"],
            "nvcc": ["-O3", "--expt-relaxed-constexpr", "-lineinfo",
                     "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                     "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"],
        },
    )
    return {"ext_modules": [ext], "cmdclass": {"build_py": BuildPyWithSources,
                                               "build_ext": BuildExtension.with_options(use_ninja=True)}}


build_cuda, reason = cuda_build_decision()
kwargs = {"cmdclass": {"build_py": BuildPyWithSources}}
if build_cuda:
    kwargs = cuda_extension_kwargs()
elif reason and os.environ.get("SSA_FLASH_BUILD_CUDA", "") != "0":
    print(f"ssa_flash: installing without the CUDA extension ({reason}); backend='cuda' will "
          "JIT-compile it on first use where a toolkit is present")

setup(**kwargs)
