"""``csrc/*.cu`` compiled once per test session, as an extension build compiles them: ``nvcc -c``
with the extension's flags (``ssa_flash.backends.cuda_backend.NVCC_FLAGS``), torch's C++ standard,
``-Xptxas -v``, one nvcc per file for every architecture CI checks (``ARCHS``; bfloat16 files at
the audit's gated head dims only, ``BF16_DIMS``). Shared by tests/cuda/test_csrc_compile.py
(errors, warnings, spills of every architecture) and
tests/audit/test_audit_cuda.py (the SASS audit of the sm_80 / sm_90a cubins in the objects), so
that CI compiles each file once instead of once per module.

One background job per file (tests/background.py, key ``csrc.<file name>``)::

    built = csrc_objects.submit("fwd_fp16.cu").result()     # a Compiled
    cubin = csrc_objects.cubin(built, "sm_90a")              # bytes of that architecture's ELF
"""
from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import NamedTuple, Optional

import background

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CU_FILES = sorted(CSRC.glob("*.cu"))
NVCC = shutil.which("nvcc")
# architectures compiled (``SSA_FLASH_COMPILE_ARCHS``, e.g. "75 80 90a"): sm_75 for the Turing
# path, sm_80 and sm_90a for the mma.sync / wgmma paths (and the audit)
ARCHS = os.environ.get("SSA_FLASH_COMPILE_ARCHS", "75 80 90a").split()
# per nvcc run (every architecture): a backward file takes minutes on an idle 2-core machine and
# over 15 on one shared by several test sessions
TIMEOUT_S = 2400


class Compiled(NamedTuple):
    """One file's nvcc run: exit status, nvcc's whole output (ptxas -v of every architecture
    included), seconds, the object (None when nvcc failed)."""
    returncode: int
    output: str
    seconds: float
    obj: Optional[Path]


def cxx_std() -> str:
    """The C++ standard torch's own extension builds use (C++20 for recent torch, else C++17)."""
    import torch.utils.cpp_extension as cpp_extension

    try:
        return "c++20" if "c++20" in inspect.getsource(cpp_extension) else "c++17"
    except (OSError, TypeError):
        return "c++17"


# The soft-capping / sink instances (csrc/dispatch.h, SSA_FLASH_EXTRAS) compiled apart: a file's
# ``<file>`` unit holds the kernels without them, for every architecture (as before the features),
# and ``<file>+extras`` only those with them, float16, head dim 128, for the mma.sync and
# wgmma paths (sm_80, sm_90a). All of them for every architecture would triple nvcc's time;
# float16 and bfloat16 share the code, and the other head dims only change tile constants (D 64
# too was 2.3x the nvcc time: bench/NOTES.md, the sessions' budget).
EXTRAS = "+extras"
EXTRAS_UNITS = [cu.name + EXTRAS for cu in CU_FILES if cu.stem.endswith("fp16")]
EXTRAS_ARCHS = [a for a in ("80", "90a") if a in ARCHS]
HEAD_DIMS = (32, 64, 96, 128, 256)  # csrc/dispatch.h


def head_dim_defines(dims) -> list:
    """``-DSSA_FLASH_HEAD_DIM_<D>=0`` for every head dim not in ``dims`` (csrc/dispatch.h)."""
    return [f"-DSSA_FLASH_HEAD_DIM_{d}=0" for d in HEAD_DIMS if d not in dims]


EXTRAS_DIMS = (128,)

# The backward unit as a build holding the sm_90a kernels compiles it (``-DSSA_FLASH_HOPPER_FWD=1``,
# ssa_flash/backends/_cuda_build.py hopper_fwd_flags: the dispatch to the sm_90a backward,
# csrc/launch_impl.h plan_bwd_call / run_bwd, its host side and the switch's entry point):
# ``bwd_fp16.cu+hopper``, sm_90a only, today's kernels at head dim 128 only (the sm_90a backward's
# instances, D 64 and 128, are all compiled whatever the head dims), no soft-capping / sink
# instances. Only compile errors and warnings are checked there (the kernels' registers:
# tests/cuda/test_hopper_bwd_sass.py). (The forward unit with the flag is left out for CI time:
# ~200 CPU-s; its kernel and host side: tests/cuda/test_hopper_fwd_emulated.py's nvcc build.)
HOPPER = "+hopper"
HOPPER_UNITS = ["bwd_fp16.cu" + HOPPER] if "90a" in ARCHS else []
HOPPER_DIMS = (128,)

# bfloat16 units at the head dims the audit gates (64, 128), float16 at every head dim: above
# sm_75 a kernel's tiles do not depend on its dtype (csrc/traits.h; sm_75 has no bfloat16
# kernels), so bfloat16 changes only the MMA instruction and the conversions, and float16's
# compile at every head dim shows each tile shape's registers and spills. Saves ~2.5 CPU-minutes
# of CI's nvcc time (bench/NOTES.md, CI time).
BF16_DIMS = (64, 128)


def unit_head_dims(name: str) -> tuple:
    """Head dims compiled into unit ``name`` (a .cu file or one of ``EXTRAS_UNITS``, ``HOPPER_UNITS``)."""
    if name.endswith(HOPPER):
        return HOPPER_DIMS
    if name.endswith(EXTRAS):
        return EXTRAS_DIMS
    return BF16_DIMS if "bf16" in name else HEAD_DIMS


def nvcc_args(archs=None) -> list:
    """nvcc's arguments (before the file): the extension's flags, every architecture of ``archs``
    (``ARCHS``)."""
    from ssa_flash.backends.cuda_backend import NVCC_FLAGS

    gencode = []
    for arch in ARCHS if archs is None else archs:
        gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    return ["-c", f"-std={cxx_std()}", *NVCC_FLAGS, *gencode, "-I", str(CSRC), "-Xptxas", "-v"]


def _compile(name: str) -> Compiled:
    extras, hopper = name.endswith(EXTRAS), name.endswith(HOPPER)
    source = name[:-len(EXTRAS)] if extras else name[:-len(HOPPER)] if hopper else name
    suffix = "_extras" if extras else "_hopper" if hopper else ""
    obj = background.tmpdir("csrc_objs") / (Path(source).stem + suffix + ".o")
    archs = EXTRAS_ARCHS if extras else ["90a"] if hopper else None
    args = [*nvcc_args(archs), f"-DSSA_FLASH_EXTRAS={2 if extras else 0}",
            *(["-DSSA_FLASH_HOPPER_FWD=1"] if hopper else []), *head_dim_defines(unit_head_dims(name))]
    start = time.monotonic()
    proc = subprocess.run([NVCC, *args, source, "-o", str(obj)], cwd=CSRC, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    return Compiled(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start,
                    obj if proc.returncode == 0 else None)


def submit(name: str) -> "background.Job":
    """The session's compile of ``csrc/<name>`` (a .cu file or one of ``EXTRAS_UNITS``, ``HOPPER_UNITS``; started now
    unless it already was)."""
    return background.submit(f"csrc.{name}", _compile, name)


def cubin(built: Compiled, gpu: str) -> bytes:
    """The ``gpu`` (``"sm_80"``, ``"sm_90a"``) ELF of an object (``cuobjdump -xelf``)."""
    from ssa_flash.audit.compile import tool

    out = background.tmpdir(f"cubin_{built.obj.stem}_{gpu}")
    proc = subprocess.run([tool("cuobjdump"), "-xelf", gpu, str(built.obj)], cwd=out, capture_output=True, text=True)
    found = sorted(out.glob(f"*.{gpu}.cubin"))
    if proc.returncode != 0 or len(found) != 1:
        raise RuntimeError(f"cuobjdump -xelf {gpu} {built.obj.name}: {found} {proc.stdout}{proc.stderr}")
    return found[0].read_bytes()


_ENTRY = re.compile(r"Compiling entry function '\S+' for '(\w+)'")


def ptxas_log(output: str, gpu: str) -> str:
    """The ``ptxas -v`` lines of ``gpu``'s entry functions (each from its "Compiling entry
    function ... for 'gpu'" line to the next entry's)."""
    keep, lines = False, []
    for line in output.splitlines():
        m = _ENTRY.search(line)
        if m:
            keep = m.group(1) == gpu
        if keep:
            lines.append(line)
    return "\n".join(lines)
