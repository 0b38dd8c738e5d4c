"""Compile bool_mask_repro.py's kernels for sm_90 without a GPU (Triton's own warmup with the
audit's stand-in driver, meta tensors: pointers 16-byte aligned, as in a real launch) and dump
TTGIR / LLIR / PTX / SASS plus a few counts.

    PYTHONPATH=/work/tritons/triton-3.6.0:. python bench/gpu_diag/compile_repro_sm90.py OUT            # every attn case
    PYTHONPATH=... python bench/gpu_diag/compile_repro_sm90.py OUT attn float32 32 32 4 3 1 1
    PYTHONPATH=... python bench/gpu_diag/compile_repro_sm90.py OUT keep_tile 32 32 4 1   # bm bn warps keep
    PYTHONPATH=... python bench/gpu_diag/compile_repro_sm90.py OUT pv_tile 16 1 1        # bm mask keep

attn args: dtype bm bn warps stages kind keep; kind 1 bool / 2 float; keep 0 none / 1 the keep
tile from i1 tiles (dropout_keep's old form) / 2 from uint32 words (its new form). Files:
OUT/<tag>.{ttgir,llir,ptx,sass}; one line of counts per kernel (prmt_lane_sel: prmt with a
selector register, the intra-warp byte-permute conversion).
"""
import itertools
import os
import re
import subprocess
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
import bool_mask_repro as R  # noqa: E402
from ssa_flash.audit import compile as acomp  # noqa: E402

DT = {"float32": torch.float32, "float16": torch.float16}


def compile_attn(dtype, bm, bn, warps, stages, kind, keep, Lq=34, Lk=19, D=16):
    meta = lambda *s, dt=dtype: torch.empty(*s, device="meta", dtype=dt)  # noqa: E731
    q, k, v, o = meta(Lq, D), meta(Lk, D), meta(Lk, D), meta(Lq, D)
    m = meta(Lq, Lk, dt=torch.uint8 if kind == 1 else torch.float32)
    prec = "ieee" if dtype == torch.float32 else "tf32"
    consts = dict(MASK_KIND=kind, KEEP=keep, BM=bm, BN=bn, D=D, PREC=prec)
    return acomp._triton_compile(R.attn, (q, k, v, m, o, Lq, Lk, Lk), consts, warps, stages, 90)[0]


def compile_keep_tile(bm, bn, warps, keep, Lq=34, Lk=19):
    x, o = (torch.empty(Lq, Lk, device="meta") for _ in range(2))
    return acomp._triton_compile(R.keep_tile, (x, o, Lq, Lk, Lk), dict(KEEP=keep, BM=bm, BN=bn), warps, 1, 90)[0]


def compile_pv_tile(bm, mask, keep, Lq=34, Lk=19, D=16):
    meta = lambda *s, dt=torch.float16: torch.empty(*s, device="meta", dtype=dt)  # noqa: E731
    args = (meta(Lq, D), meta(Lk, D), meta(Lk, D), meta(Lq, Lk, dt=torch.uint8), meta(Lq, D, dt=torch.float32),
            Lq, Lk, Lk)
    return acomp._triton_compile(R.pv_tile, args, dict(MASK=mask, KEEP=keep, BM=bm, D=D), 4, 1, 90)[0]


def sass(cubin):
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([acomp.tool("nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout


def summary(ck):
    ttgir, ptx = ck.asm["ttgir"], ck.asm["ptx"]
    cvt = re.findall(r"ttg\.convert_layout %\S+ : tensor<([^>]*)>", ttgir)
    small = [c for c in cvt if re.search(r"x(i1|i8)\b|,|xi1|xi8", c) and ("xi1" in c or "xi8" in c)]
    s = sass(ck.asm["cubin"])
    n_sass = sum(1 for ln in s.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln))
    m = re.search(r"REG:(\d+)", acomp.res_usage(ck.asm["cubin"]))
    return dict(shared=ck.metadata.shared, regs=int(m.group(1)) if m else None,
                cvt=len(cvt), cvt_i1_i8=len(small),
                st_shared_b8=sum("st.shared" in ln and "b8" in ln for ln in ptx.splitlines()),
                ld_shared_b8=sum("ld.shared" in ln and "b8" in ln for ln in ptx.splitlines()),
                stmatrix=ptx.count("stmatrix"), prmt=ptx.count("prmt"),
                # the intra-warp byte-permute conversion: prmt with a selector chosen at run time
                # (by lane) around a shfl -- the lowering Triton 3.6 gets wrong for keep tiles
                prmt_lane_sel=len(re.findall(r"prmt\.b32\s+%r\d+, %r\d+, %r\d+, %r\d+;", ptx)),
                sass=n_sass)


def main():
    out = sys.argv[1]
    which = sys.argv[2] if len(sys.argv) > 2 else "attn"
    os.makedirs(out, exist_ok=True)
    if which == "attn":
        if len(sys.argv) > 3:
            a = sys.argv[3:]
            cfgs = [(a[0], *map(int, a[1:]))]
        else:
            cfgs = [(d, *c, kind, keep) for d, c, keep, kind in itertools.product(
                DT, [(16, 16, 4, 1), (32, 32, 4, 3), (32, 32, 4, 1), (64, 64, 4, 3)], (0, 1, 2), (1, 2))
                if keep < 2 or kind == 1]
        jobs = [(f"attn-{dt}-{bm}x{bn}w{w}s{st}-{'bool' if kind == 1 else 'float'}-keep{keep}",
                 lambda c=(DT[dt], bm, bn, w, st, kind, keep): compile_attn(*c))
                for dt, bm, bn, w, st, kind, keep in cfgs]
    elif which == "keep_tile":
        bm, bn, w, keep = map(int, sys.argv[3:7])
        jobs = [(f"keep_tile-{bm}x{bn}w{w}-keep{keep}", lambda: compile_keep_tile(bm, bn, w, keep))]
    else:
        bm, mask, keep = map(int, sys.argv[3:6])
        jobs = [(f"pv_tile-{bm}x{bm}-mask{mask}-keep{keep}", lambda: compile_pv_tile(bm, mask, keep))]
    for tag, build in jobs:
        ck = build()
        for key in ("ttgir", "llir", "ptx"):
            with open(os.path.join(out, f"{tag}.{key}"), "w") as f:
                f.write(ck.asm[key])
        with open(os.path.join(out, f"{tag}.sass"), "w") as f:
            f.write(sass(ck.asm["cubin"]))
        print(triton.__version__, tag, " ".join(f"{k}={v}" for k, v in summary(ck).items()), flush=True)


if __name__ == "__main__":
    main()
