"""Runs the sm_90 PTX of bool_mask_repro.py's kernels through ptx_lockstep.py (a CPU interpreter
of the PTX, one CTA at a time, all threads in lockstep) and compares with the PyTorch reference:
which compiled kernels are wrong already in their PTX, no GPU needed.

    PYTHONPATH=/work/tritons/triton-3.6.0:. python bench/gpu_diag/check_ptx_keep.py            # every case
    PYTHONPATH=. python bench/gpu_diag/check_ptx_keep.py attn float32 32 32 4 3 1 1           # one case

attn args: dtype bm bn warps stages kind keep (kind 1 bool / 2 float; keep 0 / 1 old i1 form /
2 the integer form); keep_tile args: bm bn warps keep; pv_tile args: bm mask keep. wgmma kernels
(fp16 64x64) are skipped.
Exit status 1 when any case is wrong in its PTX.
"""
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
import bool_mask_repro as R  # noqa: E402
import compile_repro_sm90 as C  # noqa: E402
import ptx_lockstep as P  # noqa: E402

DT = {"float32": torch.float32, "float16": torch.float16}


def _run(ptx, args, nthreads, grid, buffers):
    prog = P.Program(ptx)
    names = [n for _, n in prog.params]
    vals = list(args) + [0] * (len(names) - len(args))  # Triton's trailing scratch pointers
    for cta in range(grid):
        P.CTA(prog, nthreads, dict(zip(names, vals)), buffers, ctaid=(cta, 0, 0)).run()


def check_attn(dtype, bm, bn, warps, stages, kind, keep, Lq=34, Lk=19, D=16):
    ck = C.compile_attn(DT[dtype], bm, bn, warps, stages, kind, keep, Lq, Lk, D)
    ptx = ck.asm["ptx"]
    if "wgmma" in ptx:
        return None
    dt = DT[dtype]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, D, generator=g).to(dt) for n in (Lq, Lk, Lk))
    allowed = torch.rand(Lq, Lk, generator=torch.Generator().manual_seed(2)) > 0.25
    allowed[5] = False
    mask = allowed.to(torch.uint8) if kind == 1 else torch.zeros(Lq, Lk).masked_fill(~allowed, float("-inf"))
    base = {n: 0x1000000 * (i + 1) for i, n in enumerate("QKVMO")}
    bufs = {base["Q"]: bytearray(q.contiguous().view(torch.uint8).numpy().tobytes()),
            base["K"]: bytearray(k.contiguous().view(torch.uint8).numpy().tobytes()),
            base["V"]: bytearray(v.contiguous().view(torch.uint8).numpy().tobytes()),
            base["M"]: bytearray(mask.contiguous().view(torch.uint8).numpy().tobytes()),
            base["O"]: bytearray(Lq * D * dt.itemsize)}
    _run(ptx, [base[n] for n in "QKVMO"] + [Lq, Lk, Lk], 32 * warps, triton.cdiv(Lq, bm), bufs)
    out = torch.frombuffer(bytearray(bufs[base["O"]]), dtype=dt).view(Lq, D)
    ref = R.reference(q, k, v, allowed, R.keep_ref(Lq, Lk) if keep else None)
    return (out.double() - ref).abs().max().item()


def check_keep_tile(bm, bn, warps, keep, Lq=34, Lk=19):
    ck = C.compile_keep_tile(bm, bn, warps, keep, Lq, Lk)
    x = torch.randn(Lq, Lk, generator=torch.Generator().manual_seed(1))
    bufs = {0x1000000: bytearray(x.numpy().tobytes()), 0x2000000: bytearray(Lq * Lk * 4)}
    _run(ck.asm["ptx"], [0x1000000, 0x2000000, Lq, Lk, Lk], 32 * warps, triton.cdiv(Lq, bm), bufs)
    out = torch.frombuffer(bytearray(bufs[0x2000000]), dtype=torch.float32).view(Lq, Lk)
    ref = R.keep_tile_ref(x, keep, bn)
    return (out - ref).abs().max().item()


def check_pv_tile(bm, mask, keep, Lq=34, Lk=19, D=16):
    ck = C.compile_pv_tile(bm, mask, keep, Lq, Lk, D)
    q, k, v, allowed = R.pv_inputs(Lq, Lk, D)
    bufs = {0x1000000 * (i + 1): bytearray(t.contiguous().view(torch.uint8).numpy().tobytes())
            for i, t in enumerate((q, k, v, allowed.view(torch.uint8)))}
    bufs[0x5000000] = bytearray(Lq * D * 4)
    _run(ck.asm["ptx"], [0x1000000, 0x2000000, 0x3000000, 0x4000000, 0x5000000, Lq, Lk, Lk], 128,
         triton.cdiv(Lq, bm), bufs)
    out = torch.frombuffer(bufs[0x5000000], dtype=torch.float32).view(Lq, D)
    return (out - R.pv_ref(q, k, v, allowed, mask, keep, bm)).abs().max().item()


def main():
    tol = {"float32": 1e-4, "float16": 2e-2}
    a = sys.argv[1:]
    if a and a[0] in ("keep_tile", "pv_tile"):
        cases = [(a[0], *map(int, a[1:]))]
    elif a:
        cases = [("attn", a[1], *map(int, a[2:]))]
    else:
        cases = [("keep_tile", bm, bm, 4, keep)
                 for bm, keep in ((32, 0), (32, 1), (32, 2), (16, 1), (16, 2), (64, 1), (64, 2))]
        cases += [("pv_tile", *c) for c in ((16, 1, 0), (16, 0, 1), (16, 1, 1), (16, 1, 2), (32, 1, 1))]
        cases += [("attn", d, *c, kind, keep) for d, c, keep, kind in itertools.product(
            DT, [(16, 16, 4, 1), (32, 32, 4, 3), (32, 32, 4, 1), (64, 64, 4, 3)], (0, 1, 2), (1, 2))
            if keep < 2 or kind == 1]
    bad = []
    print(f"triton {triton.__version__}, sm_90 PTX under the lockstep interpreter")
    for case in cases:
        if case[0] == "keep_tile":
            err, t = check_keep_tile(*case[1:]), 0.0
            name = f"keep_tile {case[1]}x{case[2]} w{case[3]} keep={case[4]}"
        elif case[0] == "pv_tile":
            err, t = check_pv_tile(*case[1:]), 1e-2
            name = f"pv_tile float16 {case[1]}x{case[1]} mask={case[2]} keep={case[3]}"
        else:
            err, t = check_attn(*case[1:]), tol[case[1]]
            d, bm, bn, w, st, kind, keep = case[1:]
            name = f"attn {d:8} {bm}x{bn} w{w} s{st} keep={keep} {'bool ' if kind == 1 else 'float'}"
        if err is None:
            print(f"{name}  skipped (wgmma)", flush=True)
            continue
        ok = err <= t
        print(f"{name}  max err {err:.3g}  {'ok' if ok else 'WRONG IN PTX'}", flush=True)
        if not ok:
            bad.append(name)
    print("wrong in PTX:", bad or "none")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
