"""Standalone reproducer: a boolean (uint8) attention mask against an additive float mask in a plain
Triton attention loop, at the tiles where ssa_flash's kernels fail on an H200 (Triton 3.6).

    python bench/gpu_diag/bool_mask_repro.py            # plain kernel, < 20 s on a GPU; exit 1 on a mismatch
    python bench/gpu_diag/bool_mask_repro.py --library  # also ssa_flash's failing test, each kernel forced
                                                        # to each of its sm_90 block configurations

The kernel is what ssa_flash's forward does with a mask, nothing else: S = Q K^T (ragged
Lq = 34, Lk = 19), the mask tile loaded as bytes with the bounds as the load mask and other=0
(bool) or as float32 added to S (float), an online softmax, optionally a keep-mask tile built as
ssa_flash.triton.dropout.dropout_keep builds it (tl.join / reshape / permute of i1 tiles, a
hash instead of Philox), then P V. The same mask values go in both forms, so bool and float
must agree with each other and with torch. Under TRITON_INTERPRET=1 every case passes.
bench/NOTES.md "### 2026-11-28 The boolean mask on a GPU (GPU session 3)" has the analysis.
"""
import itertools
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _word(c0, c1, SALT: tl.constexpr):
    h = c0 * 0x9E3779B1 + c1 * 0x85EBCA77 + SALT
    h = (h ^ (h >> 13)) * 0x27D4EB2F
    return (h ^ (h >> 16)) < 0x8CCCCCCC  # keeps ~55 %


@triton.jit
def _keep(start_m, start_n, BM: tl.constexpr, BN: tl.constexpr):
    # dropout_keep's structure (four words per {i, i+8} x {j, j+1}, joined and permuted into place)
    HQ: tl.constexpr = BM // 2
    HK: tl.constexpr = BN // 2
    flat = tl.arange(0, HQ * HK).to(tl.uint32)
    c0 = tl.reshape(flat % HK, (HQ, HK)) + tl.cast(start_n // 2, tl.uint32)
    c1 = tl.reshape(flat // HK, (HQ, HK)) + tl.cast(start_m // 2, tl.uint32)
    t = tl.join(tl.join(_word(c0, c1, 0x0), _word(c0, c1, 0xC2B2AE3D)),
                tl.join(_word(c0, c1, 0x85655C7A), _word(c0, c1, 0x48180AB7)))
    t = tl.reshape(t, (BM // 16, 8, HK, 2, 2))
    return tl.reshape(tl.permute(t, (0, 3, 1, 2, 4)), (BM, BN))


@triton.jit
def attn(Q, K, V, M, O, Lq, Lk, stride_mm, MASK_KIND: tl.constexpr, KEEP: tl.constexpr,
         BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < Lq, other=0.0)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    rows = tl.minimum(offs_m, Lq - 1).to(tl.int64)
    for start_n in range(0, Lk, BN):
        offs_n = start_n + tl.arange(0, BN)
        kv_ok = offs_n[:, None] < Lk
        k = tl.load(K + offs_n[:, None] * D + offs_d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(V + offs_n[:, None] * D + offs_d[None, :], mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC, out_dtype=tl.float32)
        ok = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
        ptrs = M + rows[:, None] * stride_mm + offs_n[None, :].to(tl.int64)
        if MASK_KIND == 1:
            ok = ok & (tl.load(ptrs, mask=ok, other=0) != 0)
        else:
            s = s + tl.load(ptrs, mask=ok, other=0.0)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KEEP:
            p = tl.where(_keep(tl.program_id(0) * BM, start_n, BM, BN), p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC, out_dtype=tl.float32)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + offs_m[:, None] * D + offs_d[None, :], out.to(O.dtype.element_ty), mask=offs_m[:, None] < Lq)


def keep_ref(Lq, Lk):
    """_keep's tiles as one (Lq, Lk) boolean tensor (the function does not depend on the tile)."""
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    c0, c1 = j // 2, (i // 16) * 8 + i % 8
    word = (i // 8) % 2 + 2 * (j % 2)
    M32 = 0xFFFFFFFF
    h = (c0 * 0x9E3779B1 + c1 * 0x85EBCA77 + word * 0xC2B2AE3D) & M32  # SALT = word * 0xC2B2AE3D
    h = ((h ^ (h >> 13)) * 0x27D4EB2F) & M32
    return (h ^ (h >> 16)) < 0x8CCCCCCC


def reference(q, k, v, allowed, keep):
    s = q.double() @ k.double().T
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # an empty row: output 0
    if keep is not None:
        p = p * keep
    return p @ v.double()


def run_case(dtype, bm, bn, warps, stages, mask_kind, keep, device, Lq=34, Lk=19, D=16):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, D, generator=g).to(device, dtype) for n in (Lq, Lk, Lk))
    allowed = torch.rand(Lq, Lk, generator=torch.Generator().manual_seed(2)) > 0.25
    allowed[5] = False  # an empty row, as in the failing test
    allowed = allowed.to(device)
    mask = allowed if mask_kind == 1 else torch.zeros(Lq, Lk, device=device).masked_fill(~allowed, float("-inf"))
    arg = mask.view(torch.uint8) if mask_kind == 1 else mask
    out = torch.empty(Lq, D, device=device, dtype=dtype)
    prec = "ieee" if dtype == torch.float32 else "tf32"
    extra = {} if device == "cpu" else dict(num_warps=warps, num_stages=stages)
    attn[(triton.cdiv(Lq, bm),)](q, k, v, arg, out, Lq, Lk, mask.stride(0), MASK_KIND=mask_kind, KEEP=keep,
                                 BM=bm, BN=bn, D=D, PREC=prec, **extra)
    kp = keep_ref(Lq, Lk).to(device) if keep else None
    ref = reference(q, k, v, allowed, kp)
    return (out.double() - ref).abs().max().item()


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tol = {torch.float32: 1e-4, torch.float16: 2e-2}
    configs = [(16, 16, 4, 1), (32, 32, 4, 3), (32, 32, 4, 1), (64, 64, 4, 3)]
    bad = []
    print(f"triton {triton.__version__}, torch {torch.__version__}, device "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}")
    for dtype, cfg, keep, kind in itertools.product((torch.float32, torch.float16), configs, (0, 1), (1, 2)):
        err = run_case(dtype, *cfg, kind, keep, device)
        ok = err <= tol[dtype]
        name = f"{str(dtype)[6:]:8} {cfg[0]}x{cfg[1]} w{cfg[2]} s{cfg[3]} keep={keep} {'bool ' if kind == 1 else 'float'}"
        print(f"{name}  max err {err:.3g}  {'ok' if ok else 'MISMATCH'}", flush=True)
        if not ok:
            bad.append(name)
    if "--library" in sys.argv:
        bad += library_cases()
    print("mismatches:", bad or "none")
    return 1 if bad else 0


def library_cases():
    """ssa_flash's test_gqa_mask_lengths[ssa] with each kernel forced to each sm_90 candidate."""
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
    from attn_testing import check, make_qkv
    from ssa_flash.triton import launch

    os.environ.setdefault("SSA_FLASH_AUTOTUNE", "0")  # the kernels not forced take their first choice
    orig = launch._candidates
    base = torch.rand(34, 19, generator=torch.Generator().manual_seed(2)) > 0.25
    base[5] = False
    bad = []
    for kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
        launch._chosen_blocks.clear()
        cands = orig(kernel, 90, 16, torch.float32, {"MASK_KIND": 1, "DROPOUT": True})
        for blk in cands + [launch.Blocks(16, 16, 4, 1)]:
            def pick(name, *a, _blk=blk, _k=kernel, **kw):
                c = orig(name, *a, **kw)
                return [_blk] if name == _k else c
            launch._candidates = pick
            launch._chosen_blocks.clear()
            for kind, mask in (("bool", base), ("float", torch.zeros(34, 19).masked_fill(~base, float("-inf")))):
                q, k, v = make_qkv(B=1, Hq=4, Hkv=2, Lq=34, Lk=19, D=16)
                try:
                    check("ssa", q, k, v, dropout_seed=8, dropout_p=0.45, attn_mask=mask.to(q.device), enable_gqa=True)
                    res = "ok"
                except AssertionError as err:
                    res = f"FAIL {str(err).splitlines()[0]}"
                    bad.append(f"library {kernel} {blk} {kind}")
                print(f"library {kernel:8} {blk.m}x{blk.n} w{blk.warps} s{blk.stages} {kind:5}: {res}", flush=True)
    launch._candidates = orig
    return bad


if __name__ == "__main__":
    sys.exit(main())
