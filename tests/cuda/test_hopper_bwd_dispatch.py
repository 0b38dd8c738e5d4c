"""The sm_90a backward through the dispatch: the CUDA backend's own glue
(ssa_flash/backends/cuda_backend.py backward -> the extension's bwd, here the CPU emulator built for
sm_90a with the Hopper kernels, tests/emulation.py hopper_backend_job) -> set_params.h
plan_backward -> launch_impl.h plan_bwd_call / run_bwd, the same code the binding runs, with the
run-time switch (csrc/hopper/bwd_launch.h, hopper_bwd) on.

1. Against the float64 reference (gradients by autograd) under FlashAttention's error rule: dq, dk,
   dv and SSA's db, dn, softmax / SSA, fixed or adaptive temperature, causal, GQA, D 64 / 128,
   float16 / bfloat16, a grad of the LSE; hopper_bwd_kernel is what ran (launch counts), and with
   the switch off the same call runs today's fused kernel.
2. The parameters' partials: the plan's count (key blocks x 8 warps, not today's), every slot
   written, db / dn bitwise the same under shuffled schedules and both copy modes (dQ's atomics
   aside).
3. The routing decision (hopper_bwd_declines through plan_backward): masks, dropout, windows,
   sinks, soft-capping, deterministic, head dims, the score function and the switch send a call to
   today's kernels; plans only, nothing runs.
4. The tensor maps come from the forward's cache: five a shape, hits on the same tensors, the
   addresses patched for new ones.

CI time: the shared emulator build (~2-3 min on 2 cores, with tests/cuda/test_hopper_fwd_emulated.py),
then about 15 s of tests (slow; 218 s in all here).
"""
from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch

from attn_testing import FLOORS, fa_tolerance_check
from emulation import harness, hopper_backend_job
from ssa_flash import reference, scores

pytestmark = pytest.mark.slow  # (the emulator build)

BF16, FP16 = torch.bfloat16, torch.float16
KERNEL = "hopper_bwd_kernel"


def prebuild(items):
    if any("emu" in item.fixturenames for item in items):
        hopper_backend_job()


@pytest.fixture(scope="module")
def emu():
    lib, why = hopper_backend_job().result()
    if lib is None:
        pytest.skip(why)
    h = harness()
    e = h.Emulator(lib)
    e.harness = h  # (its ctypes structures: a new harness() would make other classes)
    assert e.hopper_bwd()["built"]
    assert e.hopper_bwd(True)["enabled"]
    yield e
    e.hopper_bwd(False)  # (the library is shared with the forward's tests)


@contextlib.contextmanager
def switched(emu, on):
    before = emu.hopper_bwd()["enabled"]
    emu.hopper_bwd(on)
    try:
        yield
    finally:
        emu.hopper_bwd(before)


def _inputs(B, H, Hkv, Lq, Lk, D, dtype, score, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype)
    dout = torch.randn(B, H, Lq, D, generator=g).to(dtype)
    dlse = torch.randn(B, H, Lq, generator=g)
    params = ()
    if score == "ssa":
        params = (0.5 + torch.rand(H, generator=g), 1.0 + 1.5 * torch.rand(H, generator=g))
    return q, k, v, dout, dlse, params


def _ours(emu, q, k, v, dout, dlse, params, score, causal, adaptive):
    return emu.attention(q, k, v, score=score, params=params, causal=causal, group=q.shape[1] // k.shape[1],
                         adaptive=adaptive, dout=dout, dlse=dlse)


def _reference_grads(q, k, v, dout, dlse, params, score, causal, adaptive, dtype):
    """{q, k, v, <param>...}: autograd of ssa_flash.reference in ``dtype`` (float64: the gold)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    ps = [p.detach().to(pdtype).requires_grad_() for p in params]
    out, lse = reference.attention(*leaves, is_causal=causal, scale=q.shape[-1] ** -0.5,
                                   enable_gqa=q.shape[1] != k.shape[1], score=score, score_params=tuple(ps),
                                   adaptive_temperature=adaptive, return_lse=True)
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse.double() * dlse.double()).sum()
    got = torch.autograd.grad(loss, leaves + ps)
    return dict(zip(("q", "k", "v", *scores.get(score).params), got))


# (B, H, Hkv, Lq, Lk, D, dtype, score, causal, adaptive, dlse)
CASES = [
    (1, 2, 2, 100, 130, 64, BF16, "softmax", False, False, False),
    (1, 2, 2, 150, 120, 64, FP16, "ssa", True, False, True),  # causal, Lq != Lk, a grad of the LSE
    (1, 4, 2, 96, 140, 128, BF16, "ssa", False, False, False),  # GQA, D 128
    (1, 2, 1, 120, 120, 64, BF16, "softmax", True, True, False),  # adaptive, causal, GQA
    (2, 2, 2, 80, 100, 128, FP16, "ssa", False, True, False),  # adaptive SSA, D 128, batch 2
]


@pytest.mark.parametrize("B,H,Hkv,Lq,Lk,D,dtype,score,causal,adaptive,with_dlse", CASES)
def test_backend_backward_runs_hopper_kernel(emu, B, H, Hkv, Lq, Lk, D, dtype, score, causal, adaptive, with_dlse):
    q, k, v, dout, dlse, params = _inputs(B, H, Hkv, Lq, Lk, D, dtype, score, seed=Lq + D)
    dlse = dlse if with_dlse else None
    before, fused = emu.launches(KERNEL), emu.launches("attn_bwd_fused_kernel")
    ours = _ours(emu, q, k, v, dout, dlse, params, score, causal, adaptive)
    assert emu.launches(KERNEL) == before + 1, "the dispatch did not run the sm_90a backward"
    assert emu.launches("attn_bwd_fused_kernel") == fused
    gold = _reference_grads(q, k, v, dout, dlse, params, score, causal, adaptive, torch.float64)
    naive = _reference_grads(q, k, v, dout, dlse, params, score, causal, adaptive, dtype)
    names = scores.get(score).params
    for name in ("q", "k", "v", *names):
        got = ours[f"d{name}"]
        assert got.shape == gold[name].shape and torch.isfinite(got).all(), name
        floor = FLOORS[dtype] * ((Lq * Lk) ** 0.5 if name in names else 4)
        fa_tolerance_check(f"d{name}", got, naive[name], gold[name], floor)


def test_switch_off_runs_todays_kernel(emu):
    """Off (the default), the same call plans and runs today's fused backward; its gradients agree
    with the sm_90a backward's."""
    q, k, v, dout, _, params = _inputs(1, 2, 2, 100, 130, 64, BF16, "ssa", seed=3)
    on = _ours(emu, q, k, v, dout, None, params, "ssa", True, False)
    with switched(emu, False):
        before, fused = emu.launches(KERNEL), emu.launches("attn_bwd_fused_kernel")
        off = _ours(emu, q, k, v, dout, None, params, "ssa", True, False)
        assert emu.launches(KERNEL) == before and emu.launches("attn_bwd_fused_kernel") == fused + 1
    for name in ("dq", "dk", "dv", "db", "dn"):
        torch.testing.assert_close(on[name].float(), off[name].float(), atol=2e-2, rtol=2e-2, msg=name)


def _call(emu, q, k, v, dout, params, score):
    """emu.bwd's arguments of a plain call (no mask, dropout, window, sinks, softcap)."""
    o = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:3])
    return (dout, q, k, v, o, lse, None, None, list(params), None, None, None, None, None,
            scores.get(score).id, q.shape[-1] ** -0.5, False, q.shape[1] // k.shape[1], -1, -1, 0.0, 0, 0.0, None,
            False)


def test_partials_are_the_plans_and_schedule_independent(emu):
    """The buffer of each parameter's partials has the sm_90a plan's count (key blocks x 8 consumer
    warps: 2 x 8 at Lk = 130, where today's fused plan has 12), every slot written (the buffers
    start as NaN), and the sums (cuda_backend: one reduction over a fixed shape) bitwise the same
    for every schedule and copy mode."""
    q, k, v, dout, _, params = _inputs(1, 2, 2, 100, 130, 64, BF16, "ssa", seed=5)
    assert emu.plan(64, 64, 100, 130, "ssa", False, False, True)["num_partials"] == 16
    with switched(emu, False):
        assert emu.plan(64, 64, 100, 130, "ssa", False, False, True)["num_partials"] == 12
    sums = []
    for lazy, seed in ((False, 1), (True, 7), (False, 1234)):
        e = emu.harness.Emulator(emu.lib._name, lazy_copies=lazy, seed=seed)  # (the same library)
        before = emu.launches(KERNEL)
        _, _, _, parts, _ = e.bwd(*_call(e, q, k, v, dout, params, "ssa"))
        assert emu.launches(KERNEL) == before + 1
        assert [tuple(p.shape) for p in parts] == [(1, 2, 16)] * 2
        assert all(torch.isfinite(p).all() for p in parts), "a partial left unwritten"
        sums.append([p.sum(dim=(0, 2)) for p in parts])
    for other in sums[1:]:
        for a, b in zip(sums[0], other):
            assert torch.equal(a, b), "db / dn depend on the schedule"


def _plan_call(emu, D=64, Dv=None, score="softmax", **over):
    """The plan (a dict, hopper 0 / 1) of a (1, 2, 100, D) x (1, 2, 130, D) call with the AttnCall
    fields ``over`` set (pointers: any non-null value; the plan reads only which are present)."""
    h = emu.harness
    fn = scores.get(score)
    c = h.AttnCall(batch=1, heads=2, heads_kv=2, group=1, len_q=100, len_k=130, dim=D, dim_v=Dv or D, bf16=1,
                   score=fn.id, scale=0.125, window_left=-1, window_right=-1)
    for i in range(len(fn.params)):
        c.score_param[i] = 1
    for name, value in over.items():
        setattr(c, name, value)
    plan, _ = emu._plan(c)
    return {nm: int(getattr(plan, nm)) for nm, _ in h.BwdPlan._fields_}


def test_routing(emu):
    """hopper_bwd_declines, through the binding's plan_backward: what stays on today's kernels."""
    h = emu.harness
    assert _plan_call(emu)["hopper"] == 1
    assert _plan_call(emu, score="ssa")["hopper"] == 1 and _plan_call(emu, D=128, score="ssa")["hopper"] == 1
    assert _plan_call(emu, beta=1)["hopper"] == 1  # adaptive
    assert _plan_call(emu, causal=1)["hopper"] == 1
    routed = dict(deterministic=dict(deterministic=1), bool_mask=dict(mask_kind=1, mask=1),
                  float_mask=dict(mask_kind=2, mask=1), dropout=dict(drop_rng=1, drop_keep31=1 << 30, drop_scale=2.0),
                  window=dict(window_left=16), window_right=dict(window_right=0), sinks=dict(sinks=1),
                  softcap=dict(softcap=5.0))
    for name, over in routed.items():
        plan = _plan_call(emu, **over)
        assert plan["hopper"] == 0, name
    assert _plan_call(emu, score="logit_scale")["hopper"] == 0
    # operands a tensor map cannot address (an address off 16 bytes, a row stride of 68 elements)
    assert _plan_call(emu, q=h.Operand(ptr=8, sb=0, sh=0, sm=64))["hopper"] == 0
    assert _plan_call(emu, dout=h.Operand(ptr=16, sb=0, sh=0, sm=68))["hopper"] == 0
    assert _plan_call(emu, v=h.Operand(ptr=16, sb=0, sh=0, sm=64))["hopper"] == 1
    for D, Dv in ((32, 32), (96, 96), (256, 256), (64, 128), (128, 64), (56, 56)):
        assert _plan_call(emu, D=D, Dv=Dv)["hopper"] == 0, (D, Dv)
    with switched(emu, False):
        assert _plan_call(emu)["hopper"] == 0
    # deterministic keeps today's bitwise-reproducible two-kernel path
    assert _plan_call(emu, deterministic=1)["fused"] == 0


def test_tensor_maps_from_the_cache(emu):
    """Five maps a shape (q, dO, k, v, the float32 statistics), encoded once and then reused: the
    same tensors again are hits without patches; new tensors of the shape patch the addresses."""
    q, k, v, dout, _, params = _inputs(1, 2, 2, 64, 80, 64, FP16, "softmax", seed=9)
    emu.tma_cache(clear=True)
    args = _call(emu, q, k, v, dout, params, "softmax")
    emu.bwd(*args)
    first = emu.tma_cache()
    assert first["misses"] == 5 and first["entries"] == 5 and first["hits"] == 0
    # (the same q, k, v, dO; the statistics workspace is a new tensor of the same shape)
    emu.bwd(*args)
    again = emu.tma_cache()
    assert again["misses"] == 5 and again["hits"] == 5 and again["patches"] <= 1
    q2, k2, v2, dout2, _, _ = _inputs(1, 2, 2, 64, 80, 64, FP16, "softmax", seed=10)
    emu.bwd(*_call(emu, q2, k2, v2, dout2, params, "softmax"))
    third = emu.tma_cache()
    assert third["misses"] == 5 and third["hits"] == 10 and third["patches"] >= again["patches"] + 4


def test_forced_choice_reaches_a_prepared_backward(emu):
    """cuda_fwd_choice.forced(True) through the public function: the second call of a shape takes
    the backend's prepared call (ssa_flash.ops' call plans), whose backward sets the sm_90a switch
    as the full path's does (here switched off between the calls)."""
    import ssa_flash
    from ssa_flash.backends import cuda_fwd_choice

    q, k, v, dout, _, params = _inputs(1, 2, 2, 64, 96, 64, BF16, "ssa", seed=9)
    b, n = params
    ssa_flash.ops._call_plans.clear()
    try:
        for _ in range(2):
            emu.hopper_bwd(False)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            before = emu.launches(KERNEL)
            with cuda_fwd_choice.forced(True), ssa_flash.cuda.emulated(emu):
                out = ssa_flash.ssa_attention(*leaves, b=b, n=n, backend="cuda")
                out.backward(dout)
            assert emu.launches(KERNEL) == before + 1
    finally:
        ssa_flash.ops._call_plans.clear()
        emu.hopper_bwd(True)
