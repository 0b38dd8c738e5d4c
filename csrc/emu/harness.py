"""Python side of the CPU emulation of the CUDA kernels (see emu_runtime.h): builds the emulator
library with the host C++ compiler and runs forward, statistics and backward passes on CPU
tensors exactly as ssa_flash/cuda.py drives the extension (same layout preparation, same
adaptive-temperature glue), returning what the CUDA backend would return.

Used by tests/test_csrc_compile.py; also handy by hand:

    from harness import build, Emulator
    emu = Emulator(build("/tmp/emu"))
    res = emu.attention(q, k, v, ...)
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import torch

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent


def cuda_include_dir() -> Optional[Path]:
    """The CUDA toolkit's include dir (for cuda_fp16.h / cuda_bf16.h), or None."""
    candidates = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        candidates.append(real.parent.parent / "include")
        # a wrapper script (e.g. /usr/local/bin/nvcc -> exec /usr/local/cuda-X/bin/nvcc)
        try:
            text = Path(nvcc).read_text(errors="ignore") if Path(nvcc).stat().st_size < 4096 else ""
        except OSError:
            text = ""
        for word in text.split():
            if word.endswith("/bin/nvcc"):
                candidates.append(Path(word).parent.parent / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for c in candidates:
        if (c / "cuda_fp16.h").is_file() and (c / "cuda_bf16.h").is_file():
            return c
    return None


def build(out_dir, head_dims: Sequence[int] = (32, 64, 96, 128, 256), opt: str = "-O1",
          sm75: bool = False) -> Path:
    """Compiles csrc/emu/emu_main.cpp (and through it every kernel) for the host; returns the
    shared library. ``head_dims`` limits the instantiated head dims (compile time); ``sm75``
    emulates the Turing code path (fp16 m16n8k16 as two m16n8k8; use eager copies, as sm_75's
    synchronous loads)."""
    inc = cuda_include_dir()
    if inc is None:
        raise RuntimeError("CUDA headers (cuda_fp16.h) not found")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no host C++ compiler")
    out = Path(out_dir) / ("libssa_emu_sm75.so" if sm75 else "libssa_emu.so")
    defs = [f"-DSSA_FLASH_HEAD_DIM_{d}={int(d in head_dims)}" for d in (32, 64, 96, 128, 256)]
    cmd = [cxx, "-std=c++17", opt, "-shared", "-fPIC", "-Wno-attributes", "-U_FORTIFY_SOURCE", "-DSSA_FLASH_EMULATE",
           *defs, *(["-DSSA_FLASH_EMULATE_SM75"] if sm75 else []),
           "-I", str(CSRC), "-I", str(inc), str(HERE / "emu_main.cpp"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"emulator build failed:\n{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return out


def _round8(d: int) -> int:
    return (d + 7) // 8 * 8


class Emulator:
    def __init__(self, lib_path, lazy_copies: bool = False, seed: int = 1):
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.ssa_emu_run.restype = ctypes.c_char_p
        self.lib.ssa_emu_run.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                         ctypes.POINTER(ctypes.c_longlong), ctypes.c_double,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint]
        self.lib.ssa_emu_bwd_num_m_blocks.restype = ctypes.c_int
        self.lazy_copies = lazy_copies
        self.seed = seed

    def _run(self, op, q, k, v, o, dout, grads, stats, mask_t, kind, b, n, scale, causal, group):
        B, H, Lq, D = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
        ms = mask_t.stride() if mask_t is not None else (0, 0, 0, 0)
        ints = [B, H, Hkv, group, Lq, Lk, D, Dv, int(causal), kind, *ms]
        for t in (q, k, v, o, dout, *grads):
            ints += list(t.stride()[:3]) if t is not None else [0, 0, 0]
        iv = (ctypes.c_longlong * len(ints))(*ints)

        def ptr(t):
            return None if t is None else t.data_ptr()

        names = ["lse", "dlse", "delta", "beta", "lse_l", "entropy", "dbeta_dh", "g", "db_part", "dn_part"]
        ptrs = [ptr(q), ptr(k), ptr(v), ptr(o), ptr(dout), *(ptr(t) for t in grads),
                *(ptr(stats.get(nm)) for nm in names), ptr(mask_t), ptr(b), ptr(n)]
        arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
        err = self.lib.ssa_emu_run(op, int(q.dtype == torch.bfloat16), int(b is not None),
                                   int(stats.get("beta") is not None), iv, float(scale), arr,
                                   int(self.lazy_copies), self.seed)
        if err:
            raise RuntimeError(err.decode())

    def attention(self, q, k, v, mask=None, b=None, n=None, scale=None, causal=False, group=1,
                  adaptive=False, poly=None, threshold=0.5, dout=None, dlse=None):
        """Forward and (if dout is given) backward on CPU tensors, as the CUDA backend computes
        them. Returns a dict: out, lse, and dq, dk, dv, db, dn (backward), entropy, beta."""
        from ssa_flash import cuda as cuda_py
        from ssa_flash import temperature

        poly = poly if poly is not None else temperature.DEFAULT_POLY
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        d8, dv8 = _round8(q.shape[-1]), _round8(v.shape[-1])
        qp, kp, vp = cuda_py._prep(q.detach(), d8), cuda_py._prep(k.detach(), d8), cuda_py._prep(v.detach(), dv8)
        mask_t, kind = cuda_py._prep_mask(mask)
        bf = b.detach().float().contiguous() if b is not None else None
        nf = n.detach().float().contiguous() if n is not None else None
        B, H, Lq, _ = q.shape
        f32 = dict(dtype=torch.float32)
        res = {}
        stats = {}
        if adaptive:
            ent, lse_l = torch.full((B, H, Lq), float("nan"), **f32), torch.full((B, H, Lq), float("nan"), **f32)
            self._run(1, qp, kp, qp, None, None, (None, None, None), {"lse_l": lse_l, "entropy": ent},
                      mask_t, kind, bf, nf, scale, causal, group)
            beta, dbdh = temperature.beta_from_entropy(ent, poly, threshold)
            stats.update(beta=beta.contiguous(), lse_l=lse_l, entropy=ent, dbeta_dh=dbdh.contiguous())
            res.update(entropy=ent, beta=beta)
        o = torch.full((B, H, Lq, dv8), float("nan"), dtype=q.dtype)
        lse = torch.full((B, H, Lq), float("nan"), **f32)
        self._run(0, qp, kp, vp, o, None, (None, None, None), dict(stats, lse=lse), mask_t, kind, bf, nf,
                  scale, causal, group)
        res.update(out=o[..., : v.shape[-1]], lse=lse)
        if dout is None:
            return res
        dop = cuda_py._prep(dout.to(q.dtype), dv8)
        dq = torch.full(qp.shape, float("nan"), dtype=q.dtype)
        dk = torch.full(kp.shape, float("nan"), dtype=q.dtype)
        dv = torch.full(vp.shape, float("nan"), dtype=q.dtype)
        num_m = self.lib.ssa_emu_bwd_num_m_blocks(d8, dv8, Lq)
        bstats = dict(stats, lse=lse, dlse=None if dlse is None else dlse.float().contiguous(),
                      delta=torch.full((B, H, Lq), float("nan"), **f32))
        if adaptive:
            bstats["g"] = torch.full((B, H, Lq), float("nan"), **f32)
        if b is not None:
            bstats["db_part"] = torch.full((B, H, num_m), float("nan"), **f32)
            bstats["dn_part"] = torch.full((B, H, num_m), float("nan"), **f32)
        self._run(2, qp, kp, vp, o, dop, (dq, dk, dv), bstats, mask_t, kind, bf, nf, scale, causal, group)
        res.update(dq=dq[..., : q.shape[-1]], dk=dk[..., : k.shape[-1]], dv=dv[..., : v.shape[-1]])
        if b is not None:
            res.update(db=bstats["db_part"].sum(dim=(0, 2)), dn=bstats["dn_part"].sum(dim=(0, 2)))
        return res
