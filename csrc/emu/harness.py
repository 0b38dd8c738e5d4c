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
          sm75: bool = False, sm70: bool = False, sm90: bool = False) -> Path:
    """Compiles csrc/emu/emu_main.cpp (and through it every kernel) for the host; returns the
    shared library. ``head_dims`` limits the instantiated head dims (compile time); ``sm75``
    emulates the Turing code path (fp16 m16n8k16 as two m16n8k8; use eager copies, as sm_75's
    synchronous loads); ``sm70`` the Volta one (mma.m8n8k4 from plain shared-memory loads, the
    sm_70 accumulator layout, P / dS through per-warp shared memory; fp16 only); ``sm90`` the
    sm_90a one (the kernels' wgmma paths, swizzled shared-memory tiles read through descriptors)."""
    inc = cuda_include_dir()
    if inc is None:
        raise RuntimeError("CUDA headers (cuda_fp16.h) not found")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no host C++ compiler")
    suffix = "_sm75" if sm75 else "_sm70" if sm70 else "_sm90" if sm90 else ""
    out = Path(out_dir) / f"libssa_emu{suffix}.so"
    defs = [f"-DSSA_FLASH_HEAD_DIM_{d}={int(d in head_dims)}" for d in (32, 64, 96, 128, 256)]
    cmd = [cxx, "-std=c++17", opt, "-shared", "-fPIC", "-Wno-attributes", "-U_FORTIFY_SOURCE", "-DSSA_FLASH_EMULATE",
           *defs, *(["-DSSA_FLASH_EMULATE_SM75"] if sm75 else []),
           *(["-DSSA_FLASH_EMULATE_SM70"] if sm70 else []),
           *(["-DSSA_FLASH_EMULATE_SM90"] if sm90 else []),
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
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint,
                                         ctypes.c_int, ctypes.c_double]
        self.lib.ssa_emu_wgmma_issued.restype = ctypes.c_long
        self.lib.ssa_emu_bwd_plan.restype = None
        self.lib.ssa_emu_bwd_plan.argtypes = [ctypes.c_int] * 9 + [ctypes.POINTER(ctypes.c_int)]
        self.lazy_copies = lazy_copies
        self.seed = seed

    def _run(self, op, q, k, v, o, dout, grads, stats, mask_t, kind, b, n, scale, causal, group,
             dq_accum=None, deterministic=False, stat_rows=0, drop=(None, 0, 0.0), window=(-1, -1)):
        B, H, Lq, D = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
        ms = mask_t.stride() if mask_t is not None else (0, 0, 0, 0)
        ints = [B, H, Hkv, group, Lq, Lk, D, Dv, int(causal), kind, *ms]
        for t in (q, k, v, o, dout, *grads):
            ints += list(t.stride()[:3]) if t is not None else [0, 0, 0]
        drop_rng, drop_keep31, drop_scale = drop
        ints += [stat_rows, int(drop_keep31), int(window[0]), int(window[1])]
        iv = (ctypes.c_longlong * len(ints))(*ints)

        def ptr(t):
            return None if t is None else t.data_ptr()

        names = ["lse", "dlse", "rowstat", "beta", "lse_l", "entropy", "dbeta_dh", "unused", "db_part", "dn_part"]
        ptrs = [ptr(q), ptr(k), ptr(v), ptr(o), ptr(dout), *(ptr(t) for t in grads),
                *(ptr(stats.get(nm)) for nm in names), ptr(mask_t), ptr(b), ptr(n), ptr(dq_accum), ptr(drop_rng)]
        arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
        err = self.lib.ssa_emu_run(op, int(q.dtype == torch.bfloat16), int(b is not None),
                                   int(stats.get("beta") is not None), iv, float(scale), arr,
                                   int(self.lazy_copies), self.seed, int(deterministic), float(drop_scale))
        if err:
            raise RuntimeError(err.decode())

    # ---- the extension's interface (csrc/api.cpp), on CPU tensors -------------------------

    # A negative scale is applied as |scale| to -q, as csrc/api.cpp does (the kernels take scale >= 0).

    def fwd(self, q, k, v, mask, mask_kind, b, n, beta, scale, causal, group, stream=0, drop_rng=None,
            drop_keep31=0, drop_scale=0.0, window_left=-1, window_right=-1):
        q, scale = (-q, -scale) if scale < 0 else (q, scale)
        B, H, Lq, _ = q.shape
        o = torch.full((B, H, Lq, v.shape[-1]), float("nan"), dtype=q.dtype)
        lse = torch.full((B, H, Lq), float("nan"))
        self._run(0, q, k, v, o, None, (None, None, None), {"lse": lse, "beta": beta}, mask, mask_kind,
                  b, n, scale, causal, group, drop=(drop_rng, drop_keep31, drop_scale),
                  window=(window_left, window_right))
        return o, lse

    def stats(self, q, k, mask, mask_kind, b, n, scale, causal, group, stream=0, window_left=-1,
              window_right=-1):
        q, scale = (-q, -scale) if scale < 0 else (q, scale)
        B, H, Lq, _ = q.shape
        ent, lse_l = torch.full((B, H, Lq), float("nan")), torch.full((B, H, Lq), float("nan"))
        self._run(1, q, k, q, None, None, (None, None, None), {"lse_l": lse_l, "entropy": ent}, mask,
                  mask_kind, b, n, scale, causal, group, window=(window_left, window_right))
        return ent, lse_l

    def wgmma_issued(self) -> int:
        """wgmma operations (per thread) issued in this process so far (by any emulator library)."""
        return int(self.lib.ssa_emu_wgmma_issued())

    def plan(self, D, Dv, Lq, Lk, ssa, adaptive, deterministic, bf16, unfused_features=False):
        """The backward's plan (csrc/launch.h, BwdPlan): a dict of fused, num_partials, stat_rows,
        stat_count, accum_cols. unfused_features: dropout or a window (the two-kernel path)."""
        out = (ctypes.c_int * 5)()
        self.lib.ssa_emu_bwd_plan(D, Dv, Lq, Lk, int(ssa), int(adaptive), int(deterministic), int(bf16),
                                  int(unfused_features), out)
        return dict(zip(("fused", "num_partials", "stat_rows", "stat_count", "accum_cols"), out))

    def bwd(self, dout, q, k, v, o, lse, dlse, mask, mask_kind, b, n, beta, lse_l, entropy, dbeta_dh,
            scale, causal, group, stream=0, deterministic=False, drop_rng=None, drop_keep31=0, drop_scale=0.0,
            window_left=-1, window_right=-1):
        negated = scale < 0
        q, scale = (-q, -scale) if negated else (q, scale)
        B, H, Lq, D = q.shape
        nan = float("nan")
        # (a window: as csrc/params.h set_band's flag, which the emulated run checks the plan against)
        window = window_left >= 0 or (window_right >= 0 and not causal)
        plan = self.plan(D, v.shape[-1], Lq, k.shape[2], b is not None, beta is not None, deterministic,
                         q.dtype == torch.bfloat16, drop_rng is not None or window)
        fused = plan["fused"]
        # as csrc/api.cpp: the fused path accumulates dQ / scale in a zeroed float32 buffer padded
        # to whole tiles; the row-statistics workspace starts as NaN (every row read is written)
        dq_accum = (torch.zeros((B, H, plan["stat_rows"], plan["accum_cols"]), dtype=torch.float32)
                    if fused else None)
        dq, dk, dv = (torch.full(t.shape, nan, dtype=t.dtype) for t in (q, k, v))
        stats = dict(lse=lse, dlse=dlse, beta=beta, lse_l=lse_l, entropy=entropy, dbeta_dh=dbeta_dh,
                     rowstat=torch.full((B, H, plan["stat_rows"], plan["stat_count"]), nan))
        parts = [torch.full((B if b is not None else 0, H, plan["num_partials"]), nan) for _ in range(2)]
        if b is not None:
            stats.update(db_part=parts[0], dn_part=parts[1])
        self._run(2, q, k, v, o, dout, (None if fused else dq, dk, dv), stats, mask, mask_kind, b, n, scale,
                  causal, group, dq_accum=dq_accum, deterministic=deterministic, stat_rows=plan["stat_rows"],
                  drop=(drop_rng, drop_keep31, drop_scale), window=(window_left, window_right))
        if fused:
            dq = (dq_accum[:, :, :Lq, :D] * (-scale if negated else scale)).to(q.dtype)
        elif negated:
            dq = -dq
        return dq, dk, dv, parts[0], parts[1]

    # ---- what backend="cuda" computes --------------------------------------------------------

    def attention(self, q, k, v, mask=None, b=None, n=None, scale=None, causal=False, group=1,
                  adaptive=False, poly=None, threshold=0.5, dout=None, dlse=None, deterministic=False,
                  dropout_p=0.0, dropout_rng=None, window_size=(-1, -1)):
        """Forward and (if dout is given) backward on CPU tensors through the package's custom ops
        with ``backend="cuda"`` and this emulator as the extension (what
        ssa_flash.cuda.CudaAttentionFunction does, plus ``deterministic``). Returns a dict: out,
        lse, and dq, dk, dv, db, dn (backward)."""
        from ssa_flash import temperature
        from ssa_flash.autograd import attention
        from ssa_flash.backends import cuda as backend
        from ssa_flash.backends.spec import AttentionSpec

        poly = tuple(poly if poly is not None else temperature.DEFAULT_POLY)
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        leaves = [t.detach().requires_grad_(dout is not None) if t is not None else None
                  for t in (q, k, v, b, n)]
        spec = AttentionSpec(scale=float(scale), causal=bool(causal), group=int(group), adaptive=bool(adaptive),
                             poly=poly, threshold=float(threshold), deterministic=bool(deterministic),
                             dropout_p=float(dropout_p), dropout_rng=dropout_rng,
                             window_left=int(window_size[0]), window_right=int(window_size[1]))
        with backend.emulated(self):
            why = backend.supports(q, k, v, spec)
            if why is not None:
                raise RuntimeError(f"backend='cuda' cannot run these inputs: {why}")
            out, lse = attention(*leaves, mask, "cuda", spec)
        res = dict(out=out.detach(), lse=lse.detach())
        if dout is None:
            return res
        loss = (out.float() * dout.float()).sum()
        if dlse is not None:
            loss = loss + (torch.where(torch.isfinite(lse), lse, 0).float() * dlse.float()).sum()
        names = [nm for nm, t in zip(("dq", "dk", "dv", "db", "dn"), leaves) if t is not None]
        grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
        res.update(zip(names, grads))
        return res
