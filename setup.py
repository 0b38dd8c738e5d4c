"""Build script. The pure-Python package always installs; the CUDA extension ``ssa_flash._C``
(csrc/) is added when a CUDA toolkit and a CUDA-enabled torch are importable at build time
(see docs/cuda.md, Building).

Environment:

* ``SSA_FLASH_BUILD_CUDA=1`` builds the extension or fails saying why; ``=0`` never builds it;
  unset: build it when possible, else install the pure-Python package (the CUDA backend then
  JIT-compiles the extension on first use, see ``ssa_flash/cuda.py``). Unset, a failing build
  (torch's check that nvcc's CUDA major version is torch's, a compiler error) also falls back to
  the pure-Python package, saying why.
* ``TORCH_CUDA_ARCH_LIST`` (default ``7.5;8.0;8.6;8.9+PTX;9.0a``, with ``7.0`` first when the
  toolkit's nvcc still compiles for Volta, i.e. CUDA <= 12.x; a plain ``9.0`` is built as ``9.0a``,
  see ``ssa_flash/backends/_cuda_build.py``) and ``MAX_JOBS`` are honoured, as by every torch
  extension build (ninja is used when installed).

torch is needed at build time, so a CUDA build must not run in an isolated build environment:
``pip install --no-build-isolation .``, which builds with the environment's setuptools: it must
be at least :data:`SETUPTOOLS_FLOOR` (``pip install -U "setuptools>=77"``; older ones fail with
"invalid command 'bdist_wheel'" or reject the license metadata, so this script stops first,
saying what to run). An isolated build sees no torch and installs the pure-Python package, or
fails under ``SSA_FLASH_BUILD_CUDA=1``.

Importing this file (the tests do) defines the functions without running ``setup()``: pip and
setuptools run it as ``__main__``.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")
# PEP 639 license metadata (license = "Apache-2.0", license-files) needs 77; bdist_wheel is part
# of setuptools from 70.1 (before it came from the `wheel` package)
SETUPTOOLS_FLOOR = (77, 0)
UPGRADE_HINT = 'pip install -U "setuptools>=77" ninja'


def _load_arch_module():
    """ssa_flash/backends/_cuda_build.py, loaded by path: importing the package needs torch."""
    path = os.path.join(HERE, "ssa_flash", "backends", "_cuda_build.py")
    spec = importlib.util.spec_from_file_location("_ssa_flash_cuda_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_arch = _load_arch_module()


def setuptools_problem(version: str):
    """A message saying what to run when setuptools ``version`` is too old to build this
    package, else None."""
    nums = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if nums >= SETUPTOOLS_FLOOR:
        return None
    return (f"ssa_flash needs setuptools >= {'.'.join(map(str, SETUPTOOLS_FLOOR))} to build, this "
            f"environment has {version} (pip install --no-build-isolation uses the environment's "
            f"setuptools; older ones fail with \"invalid command 'bdist_wheel'\"). Run\n"
            f"    {UPGRADE_HINT}\nthen the install command again.")


def csrc_files(patterns=("*.h", "*.cuh", "*.cu", "*.cpp"), recursive=False):
    """csrc/'s files matching ``patterns``: the top level, or with ``recursive`` every subfolder
    too (the headers of csrc/hopper/ that the units include)."""
    out = []
    for pattern in patterns:
        where = os.path.join(CSRC, "**", pattern) if recursive else os.path.join(CSRC, pattern)
        out.extend(sorted(glob.glob(where, recursive=recursive)))
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
        for path in csrc_files(recursive=True):
            target = os.path.join(dest, os.path.relpath(path, CSRC))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(path, target)


def build_flag() -> str:
    """SSA_FLASH_BUILD_CUDA: "" (unset: build when possible), "0" or "1"."""
    flag = os.environ.get("SSA_FLASH_BUILD_CUDA", "").strip()
    if flag not in ("", "0", "1"):
        raise RuntimeError(f"SSA_FLASH_BUILD_CUDA must be 0 or 1, got {flag!r}")
    return flag


def cuda_build_decision():
    """(build: bool, reason: str). Raises under SSA_FLASH_BUILD_CUDA=1 when it cannot build."""
    flag = build_flag()
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
    return ("7.0;" if nvcc_supports("70", cuda_home) else "") + _arch.DEFAULT_ARCH_LIST


def arch_list(environ, cuda_home) -> str:
    """The TORCH_CUDA_ARCH_LIST to build with: the user's (a plain 9.0 built as 9.0a, saying so)
    or the default."""
    given = environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not given:
        return default_archs(cuda_home)
    archs, notes = _arch.normalize_arch_list(given)
    for note in notes:
        print(f"ssa_flash: {note}", file=sys.stderr)
    return archs


def fallback_message(err: BaseException) -> str:
    text = " ".join(str(err).split())
    if len(text) > 600:
        text = text[:600] + " ..."
    return (f"ssa_flash: the CUDA extension failed to build ({type(err).__name__}: {text}); installing "
            "the pure-Python package instead: backend='triton' is unaffected, backend='cuda' will try "
            "a JIT build on first use. Set SSA_FLASH_BUILD_CUDA=1 to make this an error (docs/cuda.md, "
            "Building).")


def fall_back_on_failure(base):
    """``base`` (torch's BuildExtension) whose failures, from its check that nvcc's CUDA major
    version is torch's to any compiler or linker error, leave the pure-Python package installed
    with a printed reason, unless SSA_FLASH_BUILD_CUDA=1."""

    class BuildExtOrPurePython(base):
        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as err:  # noqa: BLE001 - any failure means: no extension
                if build_flag() == "1":
                    raise
                print(fallback_message(err), file=sys.stderr)  # (pip shows it with -v)
                # nothing to copy (inplace / editable) or install: get_outputs() lists none
                self.extensions = []

    BuildExtOrPurePython.__name__ = f"{base.__name__}OrPurePython"
    return BuildExtOrPurePython


def cuda_extension_kwargs():
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list(os.environ, CUDA_HOME)
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
                     "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                     # the sm_90a warp-specialised forward and backward (_cuda_build.hopper_fwd_flags)
                     *_arch.hopper_fwd_flags(os.environ["TORCH_CUDA_ARCH_LIST"])],
        },
    )
    build_ext = fall_back_on_failure(BuildExtension.with_options(use_ninja=True))
    return {"ext_modules": [ext], "cmdclass": {"build_py": BuildPyWithSources, "build_ext": build_ext}}


class _LicenseFieldWriter:
    """A file for core metadata that writes the classic ``License`` field after
    ``License-Expression`` (setuptools >= 77 writes only the expression: older pips' ``pip show``
    then shows an empty License)."""

    def __init__(self, file, text):
        self._file, self._text = file, text

    def write(self, data):
        self._file.write(data)
        if data.startswith("License-Expression: ") and self._text:
            self._file.write(f"License: {self._text}\n")

    def __getattr__(self, name):
        return getattr(self._file, name)


def distribution_class():
    """setuptools' Distribution whose metadata (PKG-INFO, a wheel's METADATA) holds both the SPDX
    ``License-Expression`` of pyproject.toml and the classic ``License`` field with the same text."""
    from setuptools.dist import Distribution

    class DistributionWithLicenseField(Distribution):
        def __init__(self, attrs=None):
            super().__init__(attrs)
            metadata = self.metadata
            write = type(metadata).write_pkg_file

            def write_pkg_file(file):
                write(metadata, _LicenseFieldWriter(file, metadata.license_expression))

            metadata.write_pkg_file = write_pkg_file

    return DistributionWithLicenseField


def main():
    import setuptools

    problem = setuptools_problem(setuptools.__version__)
    if problem is not None:
        sys.exit(problem)
    build_cuda, reason = cuda_build_decision()
    kwargs = {"cmdclass": {"build_py": BuildPyWithSources}}
    if build_cuda:
        kwargs = cuda_extension_kwargs()
    elif reason and build_flag() != "0":
        print(f"ssa_flash: installing without the CUDA extension ({reason}); backend='cuda' will "
              "JIT-compile it on first use where a toolkit is present")
    setuptools.setup(distclass=distribution_class(), **kwargs)


if __name__ == "__main__":  # pip / setuptools' build backend run this file as __main__
    main()
