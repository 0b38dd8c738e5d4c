"""Python side of the CPU emulation of the CUDA kernels (see emu_runtime.h): builds the emulator
library with the host C++ compiler and runs forward, statistics and backward passes on CPU
tensors exactly as ssa_flash/cuda.py drives the extension (same layout preparation, same
adaptive-temperature glue), returning what the CUDA backend would return.

The emulator's C++ side stays in csrc/emu (csrc/arch.h includes emu_runtime.h when
SSA_FLASH_EMULATE is set; emu_main.cpp is the C entry points over the same launch code); this
Python side lives with its users, the tests: tests/emulation.py (the CUDA backend on CPU tensors)
and tests/cuda/test_csrc_compile.py. Also handy by hand (from the repository root):

    import sys; sys.path.insert(0, "tests")
    from emu_harness import build, Emulator
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

CSRC = Path(__file__).resolve().parent.parent / "csrc"
EMU = CSRC / "emu"


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
          sm75: bool = False, sm70: bool = False, sm90: bool = False, extras: bool = True,
          hopper_fwd: bool = False) -> Path:
    """Compiles csrc/emu/emu_main.cpp (and through it every kernel) for the host; returns the
    shared library. ``head_dims`` limits the instantiated head dims (compile time); ``sm75``
    emulates the Turing code path (fp16 m16n8k16 as two m16n8k8; use eager copies, as sm_75's
    synchronous loads); ``sm70`` the Volta one (mma.m8n8k4 from plain shared-memory loads, the
    sm_70 accumulator layout, P / dS through per-warp shared memory; fp16 only); ``sm90`` the
    sm_90a one (the kernels' wgmma paths, swizzled shared-memory tiles read through descriptors).
    ``extras=False`` leaves out the soft-capping / sink instances (``SSA_FLASH_EXTRAS=0``, csrc/dispatch.h):
    about a third of the compile time. ``hopper_fwd`` (with ``sm90``): the build holds the sm_90a
    warp-specialised forward and the dispatch picks it where it takes the call
    (``SSA_FLASH_HOPPER_FWD=1``, csrc/launch_impl.h)."""
    inc = cuda_include_dir()
    if inc is None:
        raise RuntimeError("CUDA headers (cuda_fp16.h) not found")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no host C++ compiler")
    suffix = "_sm75" if sm75 else "_sm70" if sm70 else "_sm90" if sm90 else ""
    out = Path(out_dir) / f"libssa_emu{suffix}{'' if extras else '_noextras'}{'_hopper' if hopper_fwd else ''}.so"
    defs = [f"-DSSA_FLASH_HEAD_DIM_{d}={int(d in head_dims)}" for d in (32, 64, 96, 128, 256)]
    defs.append(f"-DSSA_FLASH_EXTRAS={int(extras)}")
    if hopper_fwd:
        defs.append("-DSSA_FLASH_HOPPER_FWD=1")
    cmd = [cxx, "-std=c++17", opt, "-shared", "-fPIC", "-Wno-attributes", "-U_FORTIFY_SOURCE", "-DSSA_FLASH_EMULATE",
           *defs, *(["-DSSA_FLASH_EMULATE_SM75"] if sm75 else []),
           *(["-DSSA_FLASH_EMULATE_SM70"] if sm70 else []),
           *(["-DSSA_FLASH_EMULATE_SM90"] if sm90 else []),
           "-I", str(CSRC), "-I", str(inc), str(EMU / "emu_main.cpp"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"emulator build failed:\n{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return out


class Operand(ctypes.Structure):
    """csrc/set_params.h, Operand: a (B, H, L, D) tensor's data and (batch, head, row) strides."""
    _fields_ = [("ptr", ctypes.c_void_p), ("sb", ctypes.c_int64), ("sh", ctypes.c_int64), ("sm", ctypes.c_int64)]


_I64, _F64, _PTR = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
MAX_SCORE_PARAMS = 2  # csrc/params.h, kMaxScoreParams


class AttnCall(ctypes.Structure):
    """csrc/set_params.h, AttnCall: one call, as csrc/api.cpp describes it from tensors. Its layout
    is checked against the emulator's (ssa_emu_layout) by tests/cuda/test_csrc_compile.py."""
    _fields_ = [
        *((nm, _I64) for nm in ("batch", "heads", "heads_kv", "group", "len_q", "len_k", "dim", "dim_v", "bf16",
                                "score")),
        ("scale", _F64),
        *((nm, _I64) for nm in ("causal", "window_left", "window_right", "deterministic", "mask_kind")),
        ("mask", _PTR),
        *((nm, _I64) for nm in ("mask_sb", "mask_sh", "mask_sm", "mask_sn")),
        ("score_param", _PTR * MAX_SCORE_PARAMS), ("drop_keep31", _I64), ("drop_scale", _F64), ("drop_rng", _PTR),
        *((nm, Operand) for nm in ("q", "k", "v", "o", "dout", "dq", "dk", "dv")),
        *((nm, _PTR) for nm in ("lse", "entropy", "dlse", "beta", "lse_l", "dbeta_dh", "rowstat", "dq_accum")),
        ("dparam_part", _PTR * MAX_SCORE_PARAMS), ("sinks", _PTR),
        ("softcap", _F64), ("lse_lo", _PTR), ("dmask", _PTR), ("dmask_batch", _I64), ("dmask_heads", _I64),
    ]


class BwdPlan(ctypes.Structure):
    """csrc/launch.h, BwdPlan."""
    _fields_ = [("fused", ctypes.c_bool), *((nm, ctypes.c_int) for nm in
                                            ("num_partials", "stat_rows", "stat_count", "accum_cols")),
                ("hopper", ctypes.c_bool)]


class BwdBuffers(ctypes.Structure):
    """csrc/set_params.h, BwdBuffers: the shapes of the backward's buffers for a plan."""
    _fields_ = [("fused", _I64), ("rowstat", _I64 * 4), ("dq_accum", _I64 * 4), ("partials", _I64 * 3),
                ("nparams", _I64), ("lse_lo", _I64 * 4)]


MIRRORS = (Operand, AttnCall, BwdPlan, BwdBuffers)


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


def _operand(t: Optional[torch.Tensor]) -> Operand:
    return Operand() if t is None else Operand(t.data_ptr(), *t.stride()[:3])


def _nan(shape, dtype=torch.float32) -> torch.Tensor:
    """A buffer the kernels must overwrite (NaN shows what they leave unwritten)."""
    return torch.full(tuple(shape), float("nan"), dtype=dtype)


class Emulator:
    """The extension's interface (csrc/api.cpp: fwd, row_entropy, bwd) on CPU tensors. Like api.cpp it
    only describes the call (an AttnCall) and allocates the outputs; the checks, the parameter
    structs, the backward's plan and its buffers' shapes are csrc/set_params.h's, run by the
    emulator library. Outputs start as NaN, so that what a kernel leaves unwritten shows."""

    def __init__(self, lib_path, lazy_copies: bool = False, seed: int = 1):
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.ssa_emu_run.restype = ctypes.c_char_p
        self.lib.ssa_emu_run.argtypes = [ctypes.c_int, ctypes.POINTER(AttnCall), ctypes.c_int, ctypes.c_uint]
        self.lib.ssa_emu_bwd_plan.restype = None
        self.lib.ssa_emu_bwd_plan.argtypes = [ctypes.POINTER(AttnCall), ctypes.POINTER(BwdPlan),
                                              ctypes.POINTER(BwdBuffers)]
        self.lib.ssa_emu_layout.restype = ctypes.c_long
        self.lib.ssa_emu_layout.argtypes = [ctypes.c_char_p]
        self.lib.ssa_emu_layout_name.restype = ctypes.c_char_p
        self.lib.ssa_emu_layout_name.argtypes = [ctypes.c_int]
        self.lib.ssa_emu_wgmma_issued.restype = ctypes.c_long
        self.lib.ssa_emu_launches.restype = ctypes.c_long
        self.lib.ssa_emu_launches.argtypes = [ctypes.c_char_p]
        self.lazy_copies = lazy_copies
        self.seed = seed

    def layout(self) -> dict:
        """The library's struct layout: {"AttnCall": sizeof, "AttnCall.scale": offsetof, ...}."""
        out, i = {}, 0
        while (name := self.lib.ssa_emu_layout_name(i)) is not None:
            out[name.decode()] = int(self.lib.ssa_emu_layout(name))
            i += 1
        return out

    @staticmethod
    def _describe(q, k, dim_v, mask, params, sinks, score, scale, causal, group, window_left, window_right,
                  softcap, drop_keep31=0, drop_scale=0.0, drop_rng=None) -> AttnCall:
        """What csrc/api.cpp's describe() fills from the tensors (the mask's kind from its dtype)."""
        B, H, Lq, D = q.shape
        c = AttnCall(batch=B, heads=H, heads_kv=k.shape[1], group=group, len_q=Lq, len_k=k.shape[2], dim=D,
                     dim_v=dim_v, bf16=int(q.dtype == torch.bfloat16), score=int(score), scale=float(scale),
                     causal=int(causal), window_left=int(window_left), window_right=int(window_right),
                     q=_operand(q), k=_operand(k))
        if mask is not None:
            if mask.dtype in (torch.bool, torch.uint8):
                c.mask_kind = 1
            elif mask.dtype == torch.float32:
                c.mask_kind = 2
            else:
                raise RuntimeError(f"ssa_flash: a mask is boolean (bool / uint8) or float32 additive, got {mask.dtype}")
            c.mask = _ptr(mask)
            c.mask_sb, c.mask_sh, c.mask_sm, c.mask_sn = mask.stride()
        params = list(params)
        if len(params) > MAX_SCORE_PARAMS:
            raise RuntimeError(f"ssa_flash: at most {MAX_SCORE_PARAMS} score parameters, got {len(params)}")
        for i, t in enumerate(params):
            c.score_param[i] = _ptr(t)
        c.sinks, c.softcap = _ptr(sinks), float(softcap)
        if drop_rng is not None:
            c.drop_keep31, c.drop_scale, c.drop_rng = int(drop_keep31), float(drop_scale), _ptr(drop_rng)
        return c

    def _run(self, op: int, call: AttnCall, keep) -> None:
        del keep  # (the tensors whose pointers call holds, alive until here)
        err = self.lib.ssa_emu_run(op, ctypes.byref(call), int(self.lazy_copies), self.seed)
        if err:
            raise RuntimeError(err.decode())

    def fwd(self, q, k, v, mask, params, sinks, beta, score, scale, causal, group, window_left, window_right,
            softcap, drop_keep31, drop_scale, drop_rng, stream=0):
        c = self._describe(q, k, v.shape[-1], mask, params, sinks, score, scale, causal, group, window_left,
                           window_right, softcap, drop_keep31, drop_scale, drop_rng)
        o, lse = _nan((*q.shape[:3], v.shape[-1]), q.dtype), _nan(q.shape[:3])
        c.v, c.o, c.lse, c.beta = _operand(v), _operand(o), _ptr(lse), _ptr(beta)
        self._run(0, c, (q, k, v, mask, params, beta, drop_rng, sinks))
        return o, lse

    def row_entropy(self, q, k, mask, params, sinks, score, scale, causal, group, window_left, window_right,
                    softcap, stream=0):
        c = self._describe(q, k, q.shape[-1], mask, params, sinks, score, scale, causal, group, window_left,
                           window_right, softcap)
        ent, lse_l = _nan(q.shape[:3]), _nan(q.shape[:3])
        c.lse, c.entropy = _ptr(lse_l), _ptr(ent)
        self._run(1, c, (q, k, mask, params, sinks))
        return ent, lse_l

    def launches(self, kernel: str) -> int:
        """Launches of the kernel named ``kernel`` (e.g. ``attn_fwd_ws_kernel``) so far, in this process."""
        return int(self.lib.ssa_emu_launches(kernel.encode()))

    def hopper_fwd(self, on: Optional[bool] = None) -> dict:
        """The extension's ``hopper_fwd`` (csrc/api.cpp): the sm_90a warp-specialised forward's
        run-time switch (csrc/hopper/tma_cache.h), set when ``on`` is given; returns ``built`` (the
        library holds the kernel: ``build(hopper_fwd=True)``), ``enabled`` and the tensor-map
        cache's counters (:meth:`tma_cache`)."""
        if not hasattr(self.lib, "ssa_emu_hopper_fwd"):
            return dict(built=False, enabled=False, hits=0, misses=0, patches=0, entries=0)
        enabled = bool(self.lib.ssa_emu_hopper_fwd(-1 if on is None else int(on)))
        return dict(built=True, enabled=enabled, **self.tma_cache())

    def hopper_bwd(self, on: Optional[bool] = None) -> dict:
        """The extension's ``hopper_bwd`` (csrc/api.cpp): the sm_90a backward's run-time switch
        (csrc/hopper/bwd_launch.h), set when ``on`` is given; returns ``built`` (the library holds
        the kernel: ``build(sm90=True, hopper_fwd=True)``) and ``enabled``."""
        if not hasattr(self.lib, "ssa_emu_hopper_bwd"):
            return dict(built=False, enabled=False)
        enabled = bool(self.lib.ssa_emu_hopper_bwd(-1 if on is None else int(on)))
        return dict(built=True, enabled=enabled)

    def tma_cache(self, clear: bool = False) -> dict:
        """The tensor-map cache's counters: hits, misses (maps encoded), patches (hits whose address
        was replaced), entries held; ``clear`` empties it first."""
        self.lib.ssa_emu_tma_cache.restype = ctypes.c_long
        if clear:
            self.lib.ssa_emu_tma_cache(-1)
        return {name: int(self.lib.ssa_emu_tma_cache(i)) for i, name in enumerate(("hits", "misses", "patches",
                                                                                 "entries"))}

    def wgmma_issued(self) -> int:
        """wgmma operations (per thread) issued in this process so far (by any emulator library)."""
        return int(self.lib.ssa_emu_wgmma_issued())

    def _plan(self, call: AttnCall):
        plan, buffers = BwdPlan(), BwdBuffers()
        self.lib.ssa_emu_bwd_plan(ctypes.byref(call), ctypes.byref(plan), ctypes.byref(buffers))
        return plan, buffers

    def plan(self, D, Dv, Lq, Lk, score, adaptive, deterministic, bf16, unfused_features=False):
        """The backward's plan (csrc/launch.h, BwdPlan) for a call of these sizes and flags: a dict
        of fused, num_partials, stat_rows, stat_count, accum_cols, hopper. ``score``: the score function's
        id (or name). unfused_features: a feature the fused kernel lacks (dropout or a window; a
        window is described here)."""
        from ssa_flash import scores

        dummy = 1  # (non-null pointers: the plan reads only which inputs are present)
        c = AttnCall(batch=1, heads=1, heads_kv=1, group=1, len_q=Lq, len_k=Lk, dim=D, dim_v=Dv, bf16=int(bf16),
                     score=scores.get(score).id, scale=1.0, window_left=0 if unfused_features else -1,
                     window_right=-1, deterministic=int(deterministic), beta=dummy if adaptive else None)
        plan, _ = self._plan(c)
        return {nm: int(getattr(plan, nm)) for nm, _ in BwdPlan._fields_}

    def bwd(self, dout, q, k, v, o, lse, dlse, mask, params, sinks, beta, lse_l, entropy, dbeta_dh, score, scale,
            causal, group, window_left, window_right, softcap, drop_keep31, drop_scale, drop_rng, deterministic,
            stream=0, dmask=None):
        """csrc/api.cpp's bwd; ``dmask`` (a learned additive mask's gradient, (1 or B, 1 or H, Lq, Lk)
        contiguous float32) is written after the backward when given."""
        c = self._describe(q, k, v.shape[-1], mask, params, sinks, score, scale, causal, group, window_left,
                           window_right, softcap, drop_keep31, drop_scale, drop_rng)
        c.deterministic = int(deterministic)
        c.v, c.o, c.dout = _operand(v), _operand(o), _operand(dout)
        c.lse, c.dlse, c.beta, c.lse_l, c.entropy, c.dbeta_dh = map(_ptr, (lse, dlse, beta, lse_l, entropy, dbeta_dh))
        plan, buf = self._plan(c)
        # as csrc/api.cpp: dq is the zeroed float32 accumulator on the fused path
        dq = torch.zeros(tuple(buf.dq_accum)) if plan.fused else _nan(q.shape, q.dtype)
        dk, dv = _nan(k.shape, k.dtype), _nan(v.shape, v.dtype)
        rowstat = _nan(buf.rowstat)
        parts = [_nan(buf.partials) for _ in range(buf.nparams)]
        if plan.fused:
            c.dq_accum = _ptr(dq)
        else:
            c.dq = _operand(dq)
        c.dk, c.dv, c.rowstat = _operand(dk), _operand(dv), _ptr(rowstat)
        for i, t in enumerate(parts):
            c.dparam_part[i] = _ptr(t)
        lse_lo = _nan(buf.lse_lo) if buf.lse_lo[0] > 0 else None  # (additive masks)
        c.lse_lo = _ptr(lse_lo)
        if dmask is not None:
            if dmask.dtype != torch.float32 or not dmask.is_contiguous() or dmask.dim() != 4 or \
                    tuple(dmask.shape[2:]) != (q.shape[2], k.shape[2]):
                raise RuntimeError("ssa_flash: dmask must be a contiguous float32 (1 or B, 1 or H, Lq, Lk) tensor")
            c.dmask, c.dmask_batch, c.dmask_heads = _ptr(dmask), dmask.shape[0], dmask.shape[1]
        self._run(2, c, (dout, q, k, v, o, lse, dlse, mask, params, beta, lse_l, entropy, dbeta_dh, drop_rng, sinks,
                         parts, lse_lo, dmask))
        return dq, dk, dv, parts, rowstat

    # ---- what backend="cuda" computes --------------------------------------------------------

    def attention(self, q, k, v, mask=None, b=None, n=None, scale=None, causal=False, group=1,
                  adaptive=False, poly=None, threshold=0.5, dout=None, dlse=None, deterministic=False,
                  dropout_p=0.0, dropout_rng=None, window_size=(-1, -1), score=None, params=None, sinks=None,
                  softcap=0.0):
        """Forward and (if dout is given) backward on CPU tensors through the CUDA backend's
        functions (ssa_flash/backends/cuda_backend.py: row_entropy, forward, backward) with this
        emulator as the extension, and the adaptive temperature's glue between them as the custom
        ops run it (row entropy, beta from the entropy, forward). ``mask`` expanded to
        (B, Hq, Lq, Lk) or None. The score function: ``score`` (a registry name) with ``params``, or
        SSA when ``b`` and ``n`` are given, else softmax. Returns a dict: out, lse, and (backward)
        dq, dk, dv, each parameter's gradient by ``d<name>`` (db, dn, ds) and dsinks (with sinks):
        tensors only."""
        from ssa_flash import scores, temperature
        from ssa_flash.backends import cuda_backend as backend
        from ssa_flash.spec import AttentionSpec, TemperatureState

        if score is None:
            score, params = ("ssa", (b, n)) if b is not None else ("softmax", ())
        fn = scores.get(score)
        params = tuple(t.float().contiguous() for t in (params or ()))
        poly = tuple(poly if poly is not None else temperature.DEFAULT_POLY)
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        spec = AttentionSpec(scale=float(scale), score=fn.name, causal=bool(causal), group=int(group),
                             adaptive=bool(adaptive), poly=poly, threshold=float(threshold),
                             deterministic=bool(deterministic), dropout_p=float(dropout_p), dropout_rng=dropout_rng,
                             window_left=int(window_size[0]), window_right=int(window_size[1]),
                             softcap=float(softcap))
        sinks = None if sinks is None else sinks.float().contiguous()
        with backend.emulated(self):
            why = backend.supports(q, k, v, spec, sinks)
            if why is not None:
                raise RuntimeError(f"backend='cuda' cannot run these inputs: {why}")
            temp = None
            if spec.adaptive:
                ent, lse_l = backend.row_entropy(q, k, mask, params, sinks, spec)
                beta, dbeta_dh = temperature.beta_from_entropy(ent, spec.poly, spec.threshold)
                temp = TemperatureState(beta, lse_l, ent, dbeta_dh)
            out, lse = backend.forward(q, k, v, mask, params, sinks, None if temp is None else temp.beta, spec)
            res = dict(out=out, lse=lse)
            if dout is None:
                return res
            # (rows with no admissible key: lse -inf, and no gradient flows through it)
            dl = None if dlse is None else torch.where(torch.isfinite(lse), dlse.float(), 0.0)
            dq, dk, dv, dparams, dsinks = backend.backward(dout, q, k, v, out, lse, dl, mask, params, sinks, temp,
                                                           spec)
        res.update(dq=dq, dk=dk, dv=dv)
        res.update({f"d{name}": g for name, g in zip(fn.params, dparams)})
        if dsinks is not None:
            res["dsinks"] = dsinks
        return res
