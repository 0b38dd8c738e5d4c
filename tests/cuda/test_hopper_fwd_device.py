"""The GPU verdict of the sm_90a warp-specialised forward (csrc/hopper/): the matrix its CPU
emulation passes (tests/cuda/hopper_fwd_cases.py: score x adaptive x causal x GQA x ragged x
D 64 / 128 x float16 / bfloat16) through ``backend="cuda"`` with the kernel forced on
(ssa_flash/backends/cuda_fwd_choice.py, ``forced``), against the float64 reference under
FlashAttention's error rule, and beside today's kernel (forced off) on the same inputs. That the
new kernels are what ran is read from their tensor-map cache (csrc/hopper/tma_cache.h: four lookups
a forward, two more for the adaptive temperature's row-entropy pass), also a first check of the
driver's cuTensorMapEncodeTiled / cuTensorMapReplaceAddress.

Needs an sm_90 GPU and an extension built with the kernel (SSA_FLASH_HOPPER_FWD=1 at compile time:
bench/run_gpu.sh builds so); skips otherwise, and fails under SSA_FLASH_REQUIRE_CUDA=1 on an
sm_90 GPU whose extension lacks it. bench/run_gpu.sh runs it first ("hopper-fwd" step).
"""
from __future__ import annotations

import pytest
import torch

import hopper_device
import hopper_fwd_cases
from attn_testing import compare

pytestmark = pytest.mark.cuda


def _state():
    """The extension's switch and cache (skips without an sm_90 GPU or the kernel in the build)."""
    return hopper_device.require("fwd")


def _inputs(dtype, B, H, Hkv, Lq, Lk, D, Dv, score, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g, dtype=torch.float64)
    params = _params(score, H, g)
    return [t.to("cuda", dtype) for t in (q, k, v)], [p.to("cuda", torch.float32) for p in params]


def _params(score, heads, g):
    """Per-head parameters as the emulated matrix draws them (SSA: b, n; logit scale: one)."""
    if score == "softmax":
        return []
    if score == "ssa":
        return [0.5 + torch.rand(heads, generator=g, dtype=torch.float64),
                1.0 + 1.5 * torch.rand(heads, generator=g, dtype=torch.float64)]
    return [0.5 + torch.rand(heads, generator=g, dtype=torch.float64)]


def _attend(q, k, v, score, params, adaptive, causal, backend):
    import ssa_flash

    return ssa_flash.attention(q, k, v, is_causal=causal, score=score, score_params=params or None,
                               adaptive_temperature=adaptive, enable_gqa=q.shape[1] != k.shape[1],
                               return_lse=True, backend=backend)


@pytest.mark.parametrize("score,adaptive,dtype,B,H,Hkv,Lq,Lk,D,Dv,causal", hopper_fwd_cases.MATRIX)
def test_hopper_fwd_on_device(score, adaptive, dtype, B, H, Hkv, Lq, Lk, D, Dv, causal):
    from ssa_flash.backends import cuda_backend, cuda_fwd_choice

    _state()
    (q, k, v), params = _inputs(dtype, B, H, Hkv, Lq, Lk, D, Dv, score, seed=Lq + Lk)
    before = cuda_backend.hopper_fwd_state()
    with cuda_fwd_choice.forced(True):
        ours = _attend(q, k, v, score, params, adaptive, causal, "cuda")
    torch.cuda.synchronize()
    after = cuda_backend.hopper_fwd_state()
    # q, k, v and o for the forward, and q, k for the adaptive temperature's row-entropy pass
    lookups = 4 + (2 if adaptive else 0)
    assert after["hits"] + after["misses"] == before["hits"] + before["misses"] + lookups, \
        f"the warp-specialised kernels did not run (tensor-map lookups {before} -> {after})"
    with cuda_fwd_choice.forced(False):
        today = _attend(q, k, v, score, params, adaptive, causal, "cuda")
    naive = _attend(q, k, v, score, params, adaptive, causal, "reference")
    d = [t.double() for t in (q, k, v)]
    gold = _attend(*d, score, [p.double() for p in params], adaptive, causal, "reference")
    compare((*ours, {}), (*naive, {}), (*gold, {}), dtype, Lq, Lk)
    compare((*today, {}), (*naive, {}), (*gold, {}), dtype, Lq, Lk)


def test_tensor_map_cache_on_device():
    """The driver's patch path: the same shape on new tensors hits the cache, patches the three
    input addresses (and the output's, unless the allocator hands back the first output's memory),
    and reads the new tensors (not the first call's)."""
    from ssa_flash.backends import cuda_backend, cuda_fwd_choice

    _state()
    g = torch.Generator().manual_seed(0)
    first = [torch.randn(1, 2, 256, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3)]
    second = [torch.randn(1, 2, 256, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3)]
    with cuda_fwd_choice.forced(True):
        _attend(*first, "softmax", [], False, False, "cuda")
        before = cuda_backend.hopper_fwd_state()
        out, _ = _attend(*second, "softmax", [], False, False, "cuda")
    after = cuda_backend.hopper_fwd_state()
    assert after["hits"] == before["hits"] + 4 and after["patches"] - before["patches"] in (3, 4), (before, after)
    ref, _ = _attend(*[t.double() for t in second], "softmax", [], False, False, "reference")
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)
