"""Throwaway GPU diagnostic (not committed): where do the unexplained GPU failures differ?"""
import sys, os, time
sys.path.insert(0, "tests")
import torch
import ssa_flash
from ssa_flash import reference
from attn_testing import call, make_qkv, head_params

torch.set_printoptions(precision=3, linewidth=200)
dev = "cuda" if torch.cuda.is_available() else "cpu"


def report(name, mode, q, k, v, b, n, kw, dtype=torch.float64):
    t0 = time.time()
    ins = [q, k, v] + ([b, n] if "ssa" in mode else [])
    try:
        out, lse = call(ssa_flash, mode, q, k, v, b, n, return_lse=True, backend="triton", **kw)
    except Exception as e:
        print(name, mode, "EXC", repr(e)[:300]); return
    rq = [t.detach().double().requires_grad_() for t in ins]
    ro, rl = call(reference, mode, *rq[:3], *(rq[3:] or [None, None]), return_lse=True, **kw)
    g = torch.Generator(device=dev).manual_seed(3)
    do = torch.randn(out.shape, generator=g, device=dev, dtype=torch.float64)
    dl = torch.randn(lse.shape, generator=g, device=dev, dtype=torch.float64)
    fl = lambda l: torch.where(torch.isfinite(l), l, 0)
    ga = torch.autograd.grad((out.double() * do).sum() + (fl(lse).double() * dl).sum(), ins, allow_unused=True)
    gr = torch.autograd.grad((ro * do).sum() + (fl(rl) * dl).sum(), rq, allow_unused=True)
    print(f"== {name} {mode} ({time.time()-t0:.1f}s)")
    for nm, a, r in [("out", out, ro), ("lse", lse, rl)] + list(zip("qkvbn", ga, gr)):
        if a is None or r is None:
            print(f"  {nm}: grad None ours={a is None} ref={r is None}"); continue
        a = a.detach().double(); r = r.detach()
        fin = torch.isfinite(a) == torch.isfinite(r)
        d = torch.where(torch.isfinite(r), (a - r).abs(), torch.zeros_like(r))
        scale = r.abs().max().item() if torch.isfinite(r).any() else 0
        line = f"  {nm}: maxerr {d.max().item():.3e} (ref max {scale:.3e}) finite-mismatch {int((~fin).sum())}"
        if nm in ("out", "lse", "q") and d.dim() >= 3:
            per_row = d.reshape(*d.shape[:3], -1).amax(-1) if d.dim() == 4 else d
            line += f"\n    per-row err {per_row.flatten().tolist()[:24]}"
        if nm in ("k", "v") and d.max() > 1e-6:
            line += f"\n    per-key err {d.reshape(*d.shape[:3], -1).amax(-1).flatten().tolist()[:24]}"
        print(line)


which = sys.argv[1:] or ["bool", "gqa", "extreme", "entropy"]
if "bool" in which:
    Lq, Lk = 3, 4
    m = torch.rand(Lq, Lk, generator=torch.Generator().manual_seed(0)) > 0.4
    m[1] = False; m[0, 0] = True
    print("mask", m.int().tolist())
    for mode in ["softmax", "ssa"]:
        q, k, v = make_qkv(B=1, Hq=2, Hkv=2, Lq=Lq, Lk=Lk, D=2, dtype=torch.float64, q_scale=2.5)
        b, n = head_params(2, dtype=torch.float64)
        report("bool_mask", mode, q, k, v, b, n, {"attn_mask": m.to(dev)})
        # the same without the empty row
        m2 = m.clone(); m2[1, 1] = True
        report("bool_mask_no_empty_row", mode, q, k, v, b, n, {"attn_mask": m2.to(dev)})
        # as float mask
        fm = torch.zeros(Lq, Lk, dtype=torch.float64).masked_fill(~m, float("-inf"))
        report("float_mask_same", mode, q, k, v, b, n, {"attn_mask": fm.to(dev)})
if "gqa" in which:
    q, k, v = make_qkv(B=1, Hq=4, Hkv=2, Lq=34, Lk=19, D=16)
    mask = torch.rand(34, 19, generator=torch.Generator().manual_seed(2)) > 0.25
    mask[5] = False
    b, n = head_params(4)
    report("gqa_mask_nodrop_f32", "ssa", q, k, v, b, n, {"attn_mask": mask.to(dev), "enable_gqa": True})
if "extreme" in which:
    q, k, v = make_qkv(Lq=19, Lk=21, D=16)
    bt = torch.full((2,), 1000.0, device=dev, requires_grad=True)
    nt = torch.full((2,), 20.0, device=dev, requires_grad=True)
    report("extreme_b1000_n20_f32", "ssa_adaptive", q, k, v, bt, nt, {})
    report("extreme_b1000_n20_f32_noadapt", "ssa", q, k, v, bt, nt, {})
    q, k, v = [t.detach().double().requires_grad_() for t in (q, k, v)]
    report("extreme_b1000_n20_f64", "ssa_adaptive", q, k, v, bt.detach().double().requires_grad_(), nt.detach().double().requires_grad_(), {})
if "entropy" in which:
    q, k, v = make_qkv(B=1, Hq=2, Lq=48, Lk=48, D=16, dtype=torch.float64)
    q = (q * torch.linspace(0.2, 6.0, 48, dtype=torch.float64, device=dev).view(1, 1, 48, 1)).detach().requires_grad_()
    report("adaptive_causal_f64", "adaptive", q, k, v, None, None, {"is_causal": True})
    report("adaptive_noncausal_f64", "adaptive", q, k, v, None, None, {"is_causal": False})
