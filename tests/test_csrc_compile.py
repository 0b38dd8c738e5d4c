"""CI's only check of the CUDA C++ sources (no GPU needed): every ``csrc/*.cu`` compiles with
``nvcc -c`` to SASS for sm_80 and sm_90a (so ptxas validates every inline-asm ``mma.sync`` /
``ldmatrix`` / ``cp.async`` and every template instantiation the extension ships), without
warnings from our own files; the torch binding ``csrc/api.cpp`` compiles against torch's headers;
and the tile table the Python wrapper mirrors (``ssa_flash.cuda._smem_bytes``) matches
``csrc/traits.h``.

Skipped when nvcc is not on PATH or torch's C++ headers are missing. The .cu files are compiled
in parallel (one nvcc per file, both architectures per nvcc) in a module-scoped fixture.
Set ``SSA_FLASH_COMPILE_ARCHS`` (e.g. ``"75 80 90a"``) to check other architectures.
"""
from __future__ import annotations

import concurrent.futures
import inspect
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CU_FILES = sorted(CSRC.glob("*.cu"))
NVCC = shutil.which("nvcc")
ARCHS = os.environ.get("SSA_FLASH_COMPILE_ARCHS", "80 90a").split()
TIMEOUT_S = 900


def _torch_includes():
    paths = [Path(p) for p in cpp_extension.include_paths()]
    return paths if any((p / "ATen" / "ATen.h").is_file() for p in paths) else None


TORCH_INCLUDES = _torch_includes()

pytestmark = [
    pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH"),
    pytest.mark.skipif(TORCH_INCLUDES is None, reason="torch's C++ headers are not installed"),
]


def _cxx_std() -> str:
    """The C++ standard torch's own extension builds use (C++20 for recent torch, else C++17)."""
    try:
        return "c++20" if "c++20" in inspect.getsource(cpp_extension) else "c++17"
    except (OSError, TypeError):
        return "c++17"


def _gencode():
    flags = []
    for arch in ARCHS:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    return flags


def _nvcc(args, cwd=CSRC):
    start = time.monotonic()
    proc = subprocess.run([NVCC, *args], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def _own_warnings(output: str):
    """Compiler warnings that point into csrc/ (toolkit and torch headers are not ours)."""
    return [line for line in output.splitlines()
            if "warning" in line.lower() and re.search(r"(^|/)csrc/|^\w+\.(cu|h|cpp)\(", line)]


@pytest.fixture(scope="module")
def cu_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("csrc_objs")
    common = ["-c", f"-std={_cxx_std()}", "-O3", "--expt-relaxed-constexpr", *_gencode(),
              "-I", str(CSRC), "-Xptxas", "-warn-lmem-usage"]
    # the same flags as a torch extension build
    common += ["-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
               "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]
    jobs = max(1, min(len(CU_FILES), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {cu.name: pool.submit(_nvcc, [*common, cu.name, "-o", str(out_dir / (cu.stem + ".o"))])
                   for cu in CU_FILES}
        return {name: fut.result() for name, fut in futures.items()}


def test_there_are_sources():
    assert CU_FILES, "csrc/*.cu not found"
    assert (CSRC / "api.cpp").is_file()


@pytest.mark.parametrize("name", [cu.name for cu in CU_FILES])
def test_cu_compiles(cu_results, name):
    rc, output, seconds = cu_results[name]
    assert rc == 0, f"nvcc failed on {name} ({seconds:.0f}s):\n{output[-20000:]}"
    warnings = _own_warnings(output)
    assert not warnings, f"{name}: compiler warnings in csrc/:\n" + "\n".join(warnings[:50])


def test_binding_compiles(tmp_path):
    """api.cpp (the only file that includes torch) against torch's headers, as the host compiler
    of an extension build sees it. It includes no c10/cuda header, so CPU-only torch wheels do."""
    python_include = sysconfig.get_paths().get("include")
    if not python_include or not (Path(python_include) / "Python.h").is_file():
        pytest.skip("Python.h not found (python3-dev)")
    args = ["-c", "-x", "c++", f"-std={_cxx_std()}", "-O0", "-I", str(CSRC), "-I", python_include,
            "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H",
            "-Xcompiler", "-Wall", "-Xcompiler", "-Wno-unused-function"]
    for inc in TORCH_INCLUDES:
        args += ["-I", str(inc)]
    rc, output, seconds = _nvcc([*args, "api.cpp", "-o", str(tmp_path / "api.o")])
    assert rc == 0, f"api.cpp failed to compile ({seconds:.0f}s):\n{output[-20000:]}"
    warnings = _own_warnings(output)
    assert not warnings, "compiler warnings in csrc/api.cpp:\n" + "\n".join(warnings[:50])


def test_tile_table_matches_python(tmp_path):
    """ssa_flash.cuda mirrors the shared-memory sizes of csrc/traits.h to refuse inputs a GPU
    cannot run with a clear message; the two must agree."""
    try:
        from ssa_flash import cuda
    except ImportError:  # the package is not installed: import it from the checkout
        sys.path.insert(0, str(ROOT))
        from ssa_flash import cuda

    prog = tmp_path / "traits_dump.cpp"
    prog.write_text(
        '#include <cstdio>\n#include <initializer_list>\n#include "traits.h"\nusing namespace ssa_flash;\n'
        "int main() {\n"
        "  for (int d : {32, 64, 96, 128, 256})\n"
        "    for (int a : {0, 1}) {\n"
        "      int m = fwd_smem_bytes(d, 2);\n"
        "      if (stats_smem_bytes(d, 2) > m) m = stats_smem_bytes(d, 2);\n"
        "      if (dq_smem_bytes(d, 2) > m) m = dq_smem_bytes(d, 2);\n"
        "      if (dkdv_smem_bytes(d, 2, a) > m) m = dkdv_smem_bytes(d, 2, a);\n"
        '      std::printf("%d %d %d\\n", d, a, m);\n'
        "    }\n}\n")
    rc, output, _ = _nvcc(["-x", "c++", "-std=c++17", "-I", str(CSRC), str(prog), "-o", str(tmp_path / "dump")],
                          cwd=tmp_path)
    assert rc == 0, output
    lines = subprocess.run([str(tmp_path / "dump")], capture_output=True, text=True, check=True).stdout.split("\n")
    for line in filter(None, lines):
        d, a, m = map(int, line.split())
        assert cuda._smem_bytes(d, bool(a)) == m, f"head dim {d}, adaptive {a}: traits.h {m}"
        assert cuda._padded_head_dim(d) == d
    for d in (1, 8, 33, 59, 111, 129, 200, 256):
        assert cuda._padded_head_dim(d) in (32, 64, 96, 128, 256) and cuda._padded_head_dim(d) >= d
    assert cuda._padded_head_dim(257) == -1
