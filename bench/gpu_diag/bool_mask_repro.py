"""Standalone reproducer: a boolean (uint8) attention mask against an additive float mask in a plain
Triton attention loop, at the tiles where ssa_flash's kernels fail on an H200 (Triton 3.6).

    python bench/gpu_diag/bool_mask_repro.py            # plain kernels, ~20 s on a GPU; exit 1 on a mismatch
    python bench/gpu_diag/bool_mask_repro.py --library  # also ssa_flash's failing test, each kernel forced
                                                        # to each of its sm_90 block configurations

attn is what ssa_flash's forward does with a mask, nothing else: S = Q K^T (ragged Lq = 34,
Lk = 19), the mask tile loaded as bytes with the bounds as the load mask and other=0 (bool) or as
float32 added to S (float), an online softmax, optionally a keep-mask tile (a hash instead of
Philox) built like ssa_flash.triton.dropout.dropout_keep: keep=1 its old form (i1 tiles joined,
reshaped, permuted), keep=2 its new form (the uint32 words joined and permuted, compared at the
end; the same keep decisions), then P V. The same mask values go in both forms, so bool and float
must agree with each other and with torch. Two reduced kernels come first: keep_tile (the keep
tile alone applied to a loaded float tile, exact comparison) and pv_tile (fp16, one 16- or
32-wide tile, mask and keep selects, then P V). Under TRITON_INTERPRET=1 every case passes.
bench/gpu_diag/bool_mask.md has the analysis and the outcome each case is expected to have on a
GPU with Triton 3.6 (bench/gpu_diag/check_ptx_keep.py predicts them from the PTX on a CPU).
"""
import itertools
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _hash(c0, c1, SALT: tl.constexpr):
    h = c0 * 0x9E3779B1 + c1 * 0x85EBCA77 + SALT
    h = (h ^ (h >> 13)) * 0x27D4EB2F
    return h ^ (h >> 16)


KEEP_BELOW = tl.constexpr(0x8CCCCCCC)  # keeps ~55 %


@triton.jit
def _keep(start_m, start_n, BM: tl.constexpr, BN: tl.constexpr, FORM: tl.constexpr = 1):
    """dropout_keep's structure: four words per {i, i+8} x {j, j+1}, joined and permuted into
    place. FORM 1 (ssa_flash before the fix): the words compared first, the i1 tiles joined and
    permuted. FORM 2 (the fix): the uint32 words joined and permuted, compared at the end; the
    same keep decisions, no i1 / i8 tensor left to change layout."""
    HQ: tl.constexpr = BM // 2
    HK: tl.constexpr = BN // 2
    flat = tl.arange(0, HQ * HK).to(tl.uint32)
    c0 = tl.reshape(flat % HK, (HQ, HK)) + tl.cast(start_n // 2, tl.uint32)
    c1 = tl.reshape(flat // HK, (HQ, HK)) + tl.cast(start_m // 2, tl.uint32)
    h0, h1 = _hash(c0, c1, 0x0), _hash(c0, c1, 0xC2B2AE3D)
    h2, h3 = _hash(c0, c1, 0x85655C7A), _hash(c0, c1, 0x48180AB7)
    if FORM == 1:
        t = tl.join(tl.join(h0 < KEEP_BELOW, h1 < KEEP_BELOW), tl.join(h2 < KEEP_BELOW, h3 < KEEP_BELOW))
    else:
        t = tl.join(tl.join(h0, h1), tl.join(h2, h3))
    t = tl.reshape(t, (BM // 16, 8, HK, 2, 2))
    t = tl.reshape(tl.permute(t, (0, 3, 1, 2, 4)), (BM, BN))
    if FORM != 1:
        t = t < KEEP_BELOW
    return t


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
            p = tl.where(_keep(tl.program_id(0) * BM, start_n, BM, BN, KEEP), p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC, out_dtype=tl.float32)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + offs_m[:, None] * D + offs_d[None, :], out.to(O.dtype.element_ty), mask=offs_m[:, None] < Lq)


@triton.jit
def keep_tile(X, O, Lq, Lk, stride, KEEP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The reduced case: no attention, no mask; a float tile loaded with a row stride that has no
    known divisibility (so its layout has one element per thread, 32 lanes along a row: the layout
    the bool mask's byte load gives the logit tile in attn), the keep tile applied, stored."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    ok = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
    offs = offs_m[:, None] * stride + offs_n[None, :]
    x = tl.load(X + offs, mask=ok, other=0.0)
    if KEEP:
        x = tl.where(_keep(tl.program_id(0) * BM, 0, BM, BN, KEEP), x, 0.0)
    tl.store(O + offs, x, mask=ok)


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


@triton.jit
def pv_tile(Q, K, V, M, O, Lq, Lk, stride, MASK: tl.constexpr, KEEP: tl.constexpr, BM: tl.constexpr,
            D: tl.constexpr):
    """The second reduced case (fp16, BM x BM keys, one tile): S = Q K^T, the bool mask and the
    keep tile applied with selects, then S V. With both at 16 x 16 Triton 3.6 gives the S V dot
    kWidth = 8 operands at K = 16 and its PTX is wrong (bench/gpu_diag/bool_mask.md); the keep
    tile's form does not matter there."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < Lq, other=0.0)
    k = tl.load(K + offs_n[:, None] * D + offs_d[None, :], mask=offs_n[:, None] < Lk, other=0.0)
    v = tl.load(V + offs_n[:, None] * D + offs_d[None, :], mask=offs_n[:, None] < Lk, other=0.0)
    s = tl.dot(q, tl.trans(k))
    ok = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
    if MASK:
        ok = ok & (tl.load(M + offs_m[:, None] * stride + offs_n[None, :], mask=ok, other=0) != 0)
    s = tl.where(ok, s, 0.0)
    if KEEP:
        s = tl.where(_keep(tl.program_id(0) * BM, 0, BM, BM, KEEP), s, 0.0)
    acc = tl.dot(s.to(tl.float16), v)
    tl.store(O + offs_m[:, None] * D + offs_d[None, :], acc, mask=offs_m[:, None] < Lq)


def pv_inputs(Lq=34, Lk=19, D=16, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, D, generator=g).half().to(device) for n in (Lq, Lk, Lk))
    allowed = (torch.rand(Lq, Lk, generator=torch.Generator().manual_seed(2)) > 0.25).to(device)
    return q, k, v, allowed


def pv_ref(q, k, v, allowed, mask, keep, bm):
    """pv_tile's output: the first bm keys only."""
    s = q.float() @ k.float().T
    s = torch.where(allowed, s, 0.0) if mask else s
    s = torch.where(keep_ref(*s.shape).to(s.device), s, 0.0) if keep else s
    return s[:, :bm].half().float() @ v[:bm].float()


def keep_tile_ref(x, keep, bn):
    """keep_tile's output: the first bn columns of x, times the keep mask when keep != 0."""
    ref = torch.where(keep_ref(*x.shape).to(x.device), x, 0.0) if keep else x.clone()
    ref[:, bn:] = 0.0
    return ref


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


def run_keep_tile(bm, bn, warps, keep, device, Lq=34, Lk=19):
    x = torch.randn(Lq, Lk, generator=torch.Generator().manual_seed(1)).to(device)
    out = torch.zeros(Lq, Lk, device=device)
    extra = {} if device == "cpu" else dict(num_warps=warps, num_stages=1)
    keep_tile[(triton.cdiv(Lq, bm),)](x, out, Lq, Lk, x.stride(0), KEEP=keep, BM=bm, BN=bn, **extra)
    return (out - keep_tile_ref(x, keep, bn)).abs().max().item()


def run_pv_tile(bm, mask, keep, device, Lq=34, Lk=19, D=16):
    q, k, v, allowed = pv_inputs(Lq, Lk, D, device)
    out = torch.zeros(Lq, D, device=device)
    extra = {} if device == "cpu" else dict(num_warps=4, num_stages=1)
    pv_tile[(triton.cdiv(Lq, bm),)](q, k, v, allowed.view(torch.uint8), out, Lq, Lk, Lk, MASK=mask, KEEP=keep,
                                    BM=bm, D=D, **extra)
    return (out - pv_ref(q, k, v, allowed, mask, keep, bm)).abs().max().item()


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tol = {torch.float32: 1e-4, torch.float16: 2e-2}
    configs = [(16, 16, 4, 1), (32, 32, 4, 3), (32, 32, 4, 1), (64, 64, 4, 3)]
    bad = []
    print(f"triton {triton.__version__}, torch {torch.__version__}, device "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}")
    # The reduced case (bench/gpu_diag/bool_mask.md): no attention, no mask, exact comparison.
    # keep=1 at 32x32 is wrong in Triton 3.6's PTX (check_ptx_keep.py); keep=2 is the fix's form.
    for bm, keep in ((32, 0), (32, 1), (32, 2), (16, 1), (16, 2), (64, 1), (64, 2)):
        err = run_keep_tile(bm, bm, 4, keep, device)
        name = f"keep_tile float32 {bm}x{bm} w4 keep={keep}"
        print(f"{name}  max err {err:.3g}  {'ok' if err == 0 else 'MISMATCH'}", flush=True)
        if err != 0:
            bad.append(name)
    for bm, mask, keep in ((16, 1, 0), (16, 0, 1), (16, 1, 1), (16, 1, 2), (32, 1, 1)):
        err = run_pv_tile(bm, mask, keep, device)
        name = f"pv_tile float16 {bm}x{bm} w4 mask={mask} keep={keep}"
        print(f"{name}  max err {err:.3g}  {'ok' if err <= 1e-2 else 'MISMATCH'}", flush=True)
        if not err <= 1e-2:
            bad.append(name)
    # keep: 0 none, 1 the keep tile built from i1 tiles (the old form), 2 from uint32 words (the fix)
    cases = [(d, c, keep, kind) for d, c, keep, kind in itertools.product(
        (torch.float32, torch.float16), configs, (0, 1, 2), (1, 2)) if keep < 2 or kind == 1]
    for dtype, cfg, keep, kind in cases:
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
    from ssa_flash.triton import block_choice, launch

    os.environ.setdefault("SSA_FLASH_AUTOTUNE", "0")  # the kernels not forced take their first choice
    orig = block_choice.candidate_blocks
    base = torch.rand(34, 19, generator=torch.Generator().manual_seed(2)) > 0.25
    base[5] = False
    bad = []
    for kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
        block_choice.chosen_blocks.clear()
        cands = orig(kernel, 90, 16, torch.float32, {"MASK_KIND": 1, "DROPOUT": True})
        for blk in cands + [launch.Blocks(16, 16, 4, 1)]:
            def pick(name, *a, _blk=blk, _k=kernel, **kw):
                c = orig(name, *a, **kw)
                return [_blk] if name == _k else c
            block_choice.candidate_blocks = pick
            block_choice.chosen_blocks.clear()
            for kind, mask in (("bool", base), ("float", torch.zeros(34, 19).masked_fill(~base, float("-inf")))):
                q, k, v = make_qkv(B=1, Hq=4, Hkv=2, Lq=34, Lk=19, D=16)
                try:
                    check("ssa", q, k, v, dropout_seed=8, dropout_p=0.45, attn_mask=mask.to(q.device), enable_gqa=True)
                    res = "ok"
                except AssertionError as err:
                    res = f"FAIL {str(err).splitlines()[0]}"
                    bad.append(f"library {kernel} {blk} {kind}")
                print(f"library {kernel:8} {blk.m}x{blk.n} w{blk.warps} s{blk.stages} {kind:5}: {res}", flush=True)
    block_choice.candidate_blocks = orig
    return bad


if __name__ == "__main__":
    sys.exit(main())
