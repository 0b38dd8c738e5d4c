"""Compiles the kernels for sm_70 (Volta) without a CUDA 12 toolkit: CUDA 13's nvcc refuses
sm_70, so this drives the CUDA 12.9 compiler that PyPI wheels ship, NVRTC (CUDA C++ -> PTX,
``nvidia-cuda-nvrtc-cu12``) and ptxas (PTX -> SASS, ``nvidia-cuda-nvcc-cu12``), with the
toolkit headers of ``nvidia-cuda-runtime-cu12`` (cuda_fp16.h, ...)::

    pip install "nvidia-cuda-nvrtc-cu12==12.9.*" "nvidia-cuda-nvcc-cu12==12.9.*" \\
                "nvidia-cuda-runtime-cu12==12.9.*"
    python tools/nvrtc_build.py --arch 70 [--head-dim 128] [--out DIR]

It compiles one translation unit that explicitly instantiates every float16 kernel (bf16 needs
sm_80) of the requested head dims, so ptxas checks every mma.m8n8k4 and every instantiation of
the sm_70 code path, and reports registers and spills (``ptxas -v``). Used by
tests/cuda/test_csrc_compile.py (the sm_70 compile and spill checks).
"""
from __future__ import annotations

import argparse
import ctypes
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

CSRC = Path(__file__).resolve().parent.parent / "csrc"
HEAD_DIMS = (32, 64, 96, 128, 256)


def _wheel_dirs():
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return []
    return [Path(p) for p in getattr(nvidia, "__path__", [])]


def find_wheels() -> Tuple[Optional[Path], Optional[Path], Optional[Path]]:
    """(libnvrtc.so.12, ptxas, include dir) of the CUDA 12 wheels, None for what is missing."""
    nvrtc = ptxas = include = None
    for root in _wheel_dirs():
        for cand in sorted((root / "cuda_nvrtc" / "lib").glob("libnvrtc.so.12*")):
            nvrtc = nvrtc or cand
        cand = root / "cuda_nvcc" / "bin" / "ptxas"
        if cand.is_file():
            ptxas = ptxas or cand
        cand = root / "cuda_runtime" / "include"
        if (cand / "cuda_fp16.h").is_file():
            include = include or cand
    return nvrtc, ptxas, include


def missing_reason() -> Optional[str]:
    nvrtc, ptxas, include = find_wheels()
    what = [name for name, p in (("nvidia-cuda-nvrtc-cu12", nvrtc), ("nvidia-cuda-nvcc-cu12", ptxas),
                                 ("nvidia-cuda-runtime-cu12", include)) if p is None]
    return f"CUDA 12 wheels not installed: {', '.join(what)}" if what else None


def score_policies(csrc: Path = CSRC) -> tuple:
    """The score functions' policy types (csrc/logits.h), as csrc/dispatch.h lists them (Scores)."""
    m = re.search(r"using\s+Scores\s*=\s*ScoreList<([^>]*)>", (csrc / "dispatch.h").read_text())
    if m is None:
        raise RuntimeError("csrc/dispatch.h: no `using Scores = ScoreList<...>`")
    return tuple(t.strip() for t in m.group(1).split(",") if t.strip())


SCORES = score_policies()


def instantiations(head_dims: Sequence[int] = HEAD_DIMS, extras: Sequence[int] = ()) -> str:
    """The translation unit: every float16 kernel of the given head dims without soft-capping and
    sinks, and for the head dims in ``extras`` also the instances with both (dispatch.h,
    extras_switch; sm_70 computes the cap's tanh without MUFU.TANH: csrc/fast_math.h)."""
    lines = ['#include "fwd_kernel.h"', '#include "bwd_kernel.h"', '#include "mask_grad.h"', "namespace ssa_flash {"]
    units = [(d, False) for d in head_dims] + [(d, True) for d in extras]
    for d, extra in units:
        for ssa in SCORES:
            for ad in ("false", "true"):
                # template arguments after (Score, Adaptive): the cap and the sink (dQ: the sink only
                # with the adaptive temperature; dK/dV: the cap only)
                fwd, dq, dkdv = (", true, true", f", false, true, {ad}", ", true") if extra else ("", "", "")
                lines.append(f"template __global__ void attn_fwd_kernel<FwdTraits<{d}, __half>, {ssa}, {ad}{fwd}>(const FwdParams);")
                lines.append(f"template __global__ void attn_bwd_dq_kernel<DqTraits<{d}, __half>, {ssa}, {ad}{dq}>(const BwdParams);")
                lines.append(f"template __global__ void attn_bwd_dkdv_kernel<DkdvTraits<{d}, __half>, {ssa}, {ad}{dkdv}>(const BwdParams);")
                # a learned mask's gradient (csrc/mask_grad.h; the cap only, as dK/dV)
                lines.append(f"template __global__ void attn_bwd_mask_grad_kernel<DqTraits<{d}, __half>, {ssa}, {ad}{dkdv}>"
                             "(const MaskGradParams);")
                if d <= 64 and not extra:  # the fused backward and its pre-pass (sm_70: csrc/traits.h, bwd_fused_for)
                    lines.append(f"template __global__ void attn_bwd_dq_kernel<DqTraits<{d}, __half>, {ssa}, {ad}, true>(const BwdParams);")
                    lines.append(f"template __global__ void attn_bwd_fused_kernel<FusedTraits<{d}, __half>, {ssa}, {ad}>(const BwdParams);")
            row = ", true, true" if extra else ""
            lines.append(f"template __global__ void attn_row_entropy_kernel<FwdTraits<{d}, __half>, {ssa}{row}>(const FwdParams);")
    lines.append("}  // namespace ssa_flash")
    return "\n".join(lines) + "\n"


def nvrtc_ptx(source: str, arch: str, include_dirs: List[Path], lib: Path) -> Tuple[Optional[str], str]:
    """(PTX or None, log) of NVRTC compiling `source` for compute_<arch>."""
    nv = ctypes.CDLL(str(lib))
    prog = ctypes.c_void_p()
    rc = nv.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"ssa_flash_sm70.cu", 0, None, None)
    if rc != 0:
        return None, f"nvrtcCreateProgram failed ({rc})"
    opts = [f"--gpu-architecture=compute_{arch}", "-std=c++17", "-default-device",
            "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            *(f"-I{d}" for d in include_dirs)]
    arr = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
    rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetProgramLog(prog, log)
    log_text = log.value.decode(errors="replace")
    ptx = None
    if rc == 0:
        nv.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetPTX(prog, buf)
        ptx = buf.value.decode()
    nv.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx, log_text


def build(out_dir, arch: str = "70", head_dims: Sequence[int] = HEAD_DIMS,
          extras: Sequence[int] = ()) -> Tuple[int, str, Optional[Path]]:
    """(return code, NVRTC + ptxas output, cubin path) of compiling the fp16 kernels for sm_<arch>
    (:func:`instantiations`)."""
    nvrtc, ptxas, include = find_wheels()
    why = missing_reason()
    if why:
        return 1, why, None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ptx, log = nvrtc_ptx(instantiations(head_dims, extras), arch, [CSRC, include], nvrtc)
    if ptx is None:
        return 1, "NVRTC failed:\n" + log, None
    ptx_path = out / f"ssa_flash_sm{arch}.ptx"
    ptx_path.write_text(ptx)
    cubin = out / f"ssa_flash_sm{arch}.cubin"
    proc = subprocess.run([str(ptxas), f"-arch=sm_{arch}", "-O3", "-v", str(ptx_path), "-o", str(cubin)],
                          capture_output=True, text=True)
    return proc.returncode, log + proc.stdout + proc.stderr, cubin if proc.returncode == 0 else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="70")
    ap.add_argument("--head-dim", type=int, action="append", dest="head_dims")
    ap.add_argument("--extras-head-dim", type=int, action="append", dest="extras", default=[],
                    help="also the instances with soft-capping and sinks at this head dim")
    ap.add_argument("--out", default="build/nvrtc")
    args = ap.parse_args(argv)
    rc, log, cubin = build(args.out, args.arch, tuple(args.head_dims or HEAD_DIMS), tuple(args.extras))
    print(log)
    print(f"cubin: {cubin}" if cubin else "failed")
    return rc


if __name__ == "__main__":
    sys.exit(main())
