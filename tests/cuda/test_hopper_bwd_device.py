"""The GPU verdict of the sm_90a backward (csrc/hopper/bwd_*.h) through the dispatch: forward +
backward with ``backend="cuda"`` and the new backward switched on (the extension's hopper_bwd,
through ssa_flash/backends/cuda_fwd_choice.py ``forced(False, backward=True)``: today's forward,
so that only the backward differs), against the float64 reference under FlashAttention's error
rule, and beside today's backward (switched off) on the same inputs. That the new kernel is what
ran is read from the tensor-map cache it shares with the forward (csrc/hopper/tma_cache.h: five
lookups a backward), also a first check of the driver's float32 maps. Then the switch itself, the
routing of a masked call to today's kernels, and the parameters' gradients bitwise the same run
to run (per-warp partials summed in a fixed order; dQ's atomics excepted).

Needs an sm_90 GPU and an extension built with the sm_90a kernels (SSA_FLASH_BUILD_HOPPER_FWD=1 at
build time: bench/run_gpu.sh builds so); skips otherwise, and fails under SSA_FLASH_REQUIRE_CUDA=1
on an sm_90 GPU whose extension lacks them. bench/run_gpu.sh runs it after the forward's
("hopper-bwd" step).
"""
from __future__ import annotations

import pytest
import torch

import hopper_device
from attn_testing import compare

pytestmark = pytest.mark.cuda

BF16, FP16 = torch.bfloat16, torch.float16


def _require():
    """Skips without an sm_90 GPU or the kernel in the build."""
    hopper_device.require("bwd")


def _lookups():
    from ssa_flash.backends import cuda_backend

    s = cuda_backend.hopper_fwd_state()
    return s["hits"] + s["misses"]


def _inputs(dtype, B, H, Hkv, Lq, Lk, D, score, seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    params = []
    if score == "ssa":
        params = [0.5 + torch.rand(H, generator=g, dtype=torch.float64),
                  1.0 + 1.5 * torch.rand(H, generator=g, dtype=torch.float64)]
    return ([t.to(device, dtype) for t in (q, k, v)], dout.to(device, dtype),
            [p.to(device, torch.float32) for p in params])


def _run(qkv, dout, params, score, adaptive, causal, backend, mask=None):
    """(out, lse, {q, k, v, b, n: grads}) of one forward + backward."""
    import ssa_flash

    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    ps = [p.detach().clone().requires_grad_() for p in params]
    out, lse = ssa_flash.attention(*leaves, attn_mask=mask, is_causal=causal, score=score,
                                   score_params=ps or None, adaptive_temperature=adaptive,
                                   enable_gqa=qkv[0].shape[1] != qkv[1].shape[1], return_lse=True, backend=backend)
    grads = torch.autograd.grad(out, leaves + ps, dout.to(out.dtype))
    names = ["q", "k", "v", *(("b", "n") if score == "ssa" else ())]
    return out.detach(), lse.detach(), dict(zip(names, grads))


# (score, adaptive, dtype, B, H, Hkv, Lq, Lk, D, causal): the emulated cases and longer ones
CASES = [
    ("softmax", False, BF16, 2, 4, 4, 1024, 1024, 128, False),
    ("ssa", False, BF16, 2, 4, 4, 1024, 1024, 128, True),
    ("ssa", False, FP16, 1, 4, 2, 700, 900, 64, False),  # GQA, ragged
    ("softmax", False, FP16, 1, 2, 2, 333, 333, 64, True),
    ("softmax", True, BF16, 1, 4, 1, 512, 640, 64, True),  # adaptive, GQA 4
    ("ssa", True, BF16, 2, 2, 2, 777, 777, 128, False),
    ("ssa", True, FP16, 1, 2, 2, 2048, 2048, 128, True),
]


@pytest.mark.parametrize("score,adaptive,dtype,B,H,Hkv,Lq,Lk,D,causal", CASES)
def test_hopper_bwd_on_device(score, adaptive, dtype, B, H, Hkv, Lq, Lk, D, causal):
    from ssa_flash.backends import cuda_fwd_choice

    _require()
    qkv, dout, params = _inputs(dtype, B, H, Hkv, Lq, Lk, D, score, seed=Lq + D)
    before = _lookups()
    with cuda_fwd_choice.forced(False, backward=True):
        ours = _run(qkv, dout, params, score, adaptive, causal, "cuda")
    torch.cuda.synchronize()
    assert _lookups() == before + 5, "the sm_90a backward did not run (tensor-map lookups)"
    with cuda_fwd_choice.forced(False, backward=False):
        today = _run(qkv, dout, params, score, adaptive, causal, "cuda")
    assert _lookups() == before + 5
    naive = _run(qkv, dout, params, score, adaptive, causal, "reference")
    gold = _run([t.double() for t in qkv], dout.double(), [p.double() for p in params], score, adaptive, causal,
                "reference")
    compare(ours, naive, gold, dtype, Lq, Lk)
    compare(today, naive, gold, dtype, Lq, Lk)


def test_hopper_bwd_with_the_new_forward():
    """Both sm_90a kernels in one step (what ssa_flash.cuda_ws benchmarks): 3 + 5 lookups."""
    from ssa_flash.backends import cuda_fwd_choice

    _require()
    qkv, dout, params = _inputs(BF16, 1, 4, 4, 1024, 1024, 128, "ssa", seed=1)
    before = _lookups()
    with cuda_fwd_choice.forced(True):
        ours = _run(qkv, dout, params, "ssa", False, True, "cuda")
    torch.cuda.synchronize()
    assert _lookups() == before + 8
    naive = _run(qkv, dout, params, "ssa", False, True, "reference")
    gold = _run([t.double() for t in qkv], dout.double(), [p.double() for p in params], "ssa", False, True,
                "reference")
    compare(ours, naive, gold, BF16, 1024, 1024)


def test_hopper_bwd_switch_and_routing():
    """The extension's switch reads back; a masked call (routed) and a deterministic one stay on
    today's kernels (no lookups) with the switch on."""
    from ssa_flash.backends import cuda_backend, cuda_fwd_choice

    _require()
    qkv, dout, params = _inputs(BF16, 1, 2, 2, 256, 256, 64, "softmax", seed=2)
    ext = cuda_backend.load_extension()
    was = ext.hopper_bwd()["enabled"]
    try:
        assert ext.hopper_bwd(True)["enabled"] and not ext.hopper_bwd(False)["enabled"]
    finally:
        ext.hopper_bwd(was)
    mask = torch.rand(256, 256, device="cuda") > 0.2
    before = _lookups()
    with cuda_fwd_choice.forced(False, backward=True):
        _run(qkv, dout, params, "softmax", False, False, "cuda", mask=mask)
        import ssa_flash

        leaves = [t.detach().clone().requires_grad_() for t in qkv]
        out = ssa_flash.softmax_attention(*leaves, backend="cuda", deterministic=True)
        out.backward(dout)
    torch.cuda.synchronize()
    assert _lookups() == before


def test_hopper_bwd_parameter_grads_reproducible():
    """db, dn: per-(key block, warp) partials reduced in a fixed order, bitwise the same twice
    (dq, with red.global.add, only close)."""
    from ssa_flash.backends import cuda_fwd_choice

    _require()
    qkv, dout, params = _inputs(BF16, 2, 4, 2, 1000, 1200, 128, "ssa", seed=4)
    with cuda_fwd_choice.forced(False, backward=True):
        first = _run(qkv, dout, params, "ssa", False, True, "cuda")
        again = _run(qkv, dout, params, "ssa", False, True, "cuda")
    for name in ("k", "v", "b", "n"):
        assert torch.equal(first[2][name], again[2][name]), f"d{name} differs run to run"
    torch.testing.assert_close(first[2]["q"], again[2]["q"], atol=1e-2, rtol=1e-2)
