"""The sm_90a warp-specialised backward (csrc/hopper/bwd_*.h) in the CPU emulation (csrc/emu;
the kernel built with the host compiler from tests/cuda/hopper_bwd_emu.cpp): the pre-pass and the
kernel on CPU tensors, described as the binding would (tests/emu_harness.py's AttnCall).

1. Against the float64 reference (ssa_flash.reference, gradients by autograd) with FlashAttention's
   error rule (tests/attn_testing.py): dq, dk, dv and (SSA) db, dn, for softmax and SSA, with and
   without the adaptive temperature, causal or not, GQA, ragged lengths, D 64 / 128, fp16 / bf16,
   TMA loads and wgmma performed at issue or at their wait, shuffled schedules.
2. dK, dV, db, dn bitwise the same under every schedule and copy mode (dQ is added with atomics
   in the order blocks run: checked against the reference only).
3. Broken variants (a consumer that skips the full barrier's wait, a producer waiting on the wrong
   parity, a stage released before its GEMMs read it, a stage never released) reported: an error
   (deadlock, loads never consumed) or results that differ.
4. The routing (hopper_bwd_unsupported): what goes to today's kernels.

Skipped without the CUDA headers or a host compiler. (The sm_90a SASS checks:
tests/cuda/test_hopper_bwd_sass.py.)
"""
from __future__ import annotations

import ctypes
import math
import re
from pathlib import Path

import pytest
import torch

import background
from attn_testing import FLOORS, fa_tolerance_check, head_params
from emulation import build_test_library, harness
from ssa_flash import reference, scores, temperature

pytestmark = pytest.mark.slow  # (builds, and runs the emulation)

HERE = Path(__file__).resolve().parent
(OK, NO_FULL_WAIT, WRONG_EMPTY_PARITY, EARLY_RELEASE, NO_RELEASE) = range(5)  # bwd_mainloop.h, BwdBug


def _build():
    """(library path, None) or (None, why)."""
    return build_test_library(HERE / "hopper_bwd_emu.cpp", background.tmpdir("hopper_bwd_emu"), "libhopper_bwd.so",
                              defines=("-DSSA_FLASH_EMULATE_SM90",))


def prebuild(items):
    if any("hbwd" in item.fixturenames for item in items):
        background.submit("hopper_bwd.emu", _build)


@pytest.fixture(scope="module")
def hbwd():
    lib, why = background.submit("hopper_bwd.emu", _build).result()
    if lib is None:
        pytest.skip(why)
    h = harness()
    dll = ctypes.CDLL(str(lib))
    dll.hopper_bwd_emu_run.restype = ctypes.c_char_p
    dll.hopper_bwd_emu_run.argtypes = [ctypes.POINTER(h.AttnCall), ctypes.c_int, ctypes.c_uint, ctypes.c_int]
    dll.hopper_bwd_emu_unsupported.restype = ctypes.c_char_p
    dll.hopper_bwd_emu_unsupported.argtypes = [ctypes.POINTER(h.AttnCall)]
    dll.hopper_bwd_emu_plan.restype = None
    dll.hopper_bwd_emu_plan.argtypes = [ctypes.POINTER(h.AttnCall), ctypes.POINTER(ctypes.c_int)]
    return h, dll


class Case:
    """One call's inputs (q, k, v, dout in ``dtype``; the score's per-head parameters float32) and
    what a forward would have given the backward (in float64 from the rounded inputs): o (dtype),
    lse and, adaptive, beta, lse_l, entropy, dbeta_dh (float32)."""

    def __init__(self, B=1, H=2, Hkv=None, Lq=100, Lk=None, D=64, dtype=torch.bfloat16, score="softmax",
                 causal=False, adaptive=False, seed=0, blhd=False):
        Hkv = Hkv or H
        Lk = Lk or Lq
        g = torch.Generator().manual_seed(seed)
        self.dtype, self.score, self.causal, self.adaptive, self.group = dtype, scores.get(score), causal, adaptive, H // Hkv
        # (B, H, L, D) views of (B, H, L, D) storage, or of (B, L, H, D) storage with blhd
        make = ((lambda b, h, l: torch.randn(b, l, h, D, generator=g).to(dtype).transpose(1, 2)) if blhd else
                (lambda b, h, l: torch.randn(b, h, l, D, generator=g).to(dtype)))
        self.q, self.k, self.v = make(B, H, Lq), make(B, Hkv, Lk), make(B, Hkv, Lk)
        self.dout = make(B, H, Lq)
        self.scale = D ** -0.5
        self.params = tuple(t.detach().float() for t in head_params(H, seed=seed + 1))[:len(self.score.params)]
        with torch.no_grad():
            out, lse = self._reference(torch.float64)
        self.o, self.lse = out.to(dtype), lse.float()
        if adaptive:
            logits, allowed = reference._logit_rows(self.q.double(), self.k.double(), None, causal, self.scale,
                                                    self.group > 1, self.score, tuple(p.double() for p in self.params))
            ent = reference._entropy(logits, allowed)
            beta, dbdh = temperature.beta_from_entropy_torch(ent, temperature.DEFAULT_POLY,
                                                             temperature.DEFAULT_THRESHOLD)
            self.entropy, self.beta, self.dbeta_dh = ent.float(), beta.float(), dbdh.float()
            self.lse_l = torch.logsumexp(logits, dim=-1).float()

    def _reference(self, dtype, q=None, k=None, v=None, params=None):
        q = self.q.to(dtype) if q is None else q
        k = self.k.to(dtype) if k is None else k
        v = self.v.to(dtype) if v is None else v
        params = tuple(p.to(dtype if dtype == torch.float64 else torch.float32) for p in self.params) \
            if params is None else params
        return reference.attention(q, k, v, is_causal=self.causal, scale=self.scale, enable_gqa=self.group > 1,
                                   score=self.score.name, score_params=params, adaptive_temperature=self.adaptive,
                                   return_lse=True)

    def grads(self, dtype):
        """Autograd of the reference in ``dtype`` (float64: the gold): {q, k, v, params...}."""
        leaves = [t.detach().to(dtype).requires_grad_() for t in (self.q, self.k, self.v)]
        params = [p.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
                  for p in self.params]
        out, _ = self._reference(dtype, *leaves, params=tuple(params))
        loss = (out.to(torch.float64) * self.dout.to(torch.float64)).sum()
        got = torch.autograd.grad(loss, leaves + params)
        return dict(zip(("q", "k", "v", *self.score.params), got))


def _call(h, dll, case: Case, deterministic=False):
    """(AttnCall, buffers dict, keep-alive list) for the case."""
    c = h.Emulator._describe(case.q, case.k, case.v.shape[-1], None, case.params, None, case.score.id, case.scale,
                             case.causal, case.group, -1, -1, 0.0)
    c.deterministic = int(deterministic)
    c.v, c.o, c.dout = h._operand(case.v), h._operand(case.o), h._operand(case.dout)
    c.lse = case.lse.data_ptr()
    keep = [case]
    if case.adaptive:
        for name in ("beta", "lse_l", "entropy", "dbeta_dh"):
            setattr(c, name, getattr(case, name).data_ptr())
    plan = (ctypes.c_int * 4)()
    dll.hopper_bwd_emu_plan(ctypes.byref(c), plan)
    num_partials, stat_rows, stat_count, accum_cols = list(plan)
    B, H, Lq, D = case.q.shape
    buf = dict(dq=torch.zeros(B, H, stat_rows, accum_cols), dk=torch.full_like(case.k, float("nan")),
               dv=torch.full_like(case.v, float("nan")), rowstat=torch.full((B, H, stat_rows, stat_count), float("nan")),
               parts=[torch.full((B, H, num_partials), float("nan")) for _ in case.params])
    c.dq_accum, c.rowstat = buf["dq"].data_ptr(), buf["rowstat"].data_ptr()
    c.dk, c.dv = h._operand(buf["dk"]), h._operand(buf["dv"])
    for i, t in enumerate(buf["parts"]):
        c.dparam_part[i] = t.data_ptr()
    return c, buf, keep


def run_kernel(hbwd, case: Case, lazy=False, seed=1, bug=OK):
    """(error, {q, k, v, params...} gradients as the binding would return them)."""
    h, dll = hbwd
    c, buf, keep = _call(h, dll, case)
    err = dll.hopper_bwd_emu_run(ctypes.byref(c), int(lazy), seed, bug).decode()
    del keep
    Lq, D = case.q.shape[2], case.q.shape[3]
    out = dict(q=buf["dq"][:, :, :Lq, :D] * case.scale, k=buf["dk"], v=buf["dv"])
    for name, t in zip(case.score.params, buf["parts"]):
        out[name] = t.double().sum(dim=(0, 2)).float()
    return err, out


def check_against_reference(case: Case, ours: dict):
    gold, naive = case.grads(torch.float64), case.grads(case.dtype)
    floor = FLOORS[case.dtype]
    Lq, Lk = case.q.shape[2], case.k.shape[2]
    for name, grad in ours.items():
        assert torch.isfinite(grad).all(), f"d{name} not finite"
        assert grad.shape == gold[name].shape, f"d{name}: shape {tuple(grad.shape)}"
        gfloor = floor * (math.sqrt(Lq * Lk) if name in case.score.params else 4)
        fa_tolerance_check(f"d{name}", grad, naive[name], gold[name], gfloor)


# (B, H, Hkv, Lq, Lk, D, dtype, score, causal, adaptive, lazy, seed): every feature in a few
# small cases (two key blocks at most where that suffices: the emulation runs 384 fibers per CTA)
CASES = [
    (1, 2, 2, 100, 100, 64, torch.bfloat16, "softmax", False, False, False, 1),
    (1, 2, 2, 150, 200, 64, torch.float16, "ssa", False, False, True, 7),
    (1, 2, 2, 190, 190, 64, torch.bfloat16, "ssa", True, False, False, 3),
    (1, 4, 2, 130, 140, 64, torch.bfloat16, "softmax", True, False, True, 5),  # GQA, causal, ragged
    (1, 2, 1, 96, 160, 128, torch.bfloat16, "ssa", False, False, False, 11),  # GQA, D 128
    (1, 1, 1, 200, 200, 128, torch.float16, "softmax", True, False, True, 2),
    (1, 2, 2, 120, 120, 64, torch.bfloat16, "softmax", False, True, False, 4),  # adaptive
    (2, 2, 1, 80, 150, 64, torch.float16, "ssa", True, True, True, 9),  # adaptive, causal, GQA, batch 2
    (1, 1, 1, 140, 100, 128, torch.bfloat16, "ssa", False, True, True, 6),  # adaptive D 128
]


@pytest.mark.parametrize("B,H,Hkv,Lq,Lk,D,dtype,score,causal,adaptive,lazy,seed", CASES)
def test_hopper_bwd_matches_reference(hbwd, B, H, Hkv, Lq, Lk, D, dtype, score, causal, adaptive, lazy, seed):
    case = Case(B, H, Hkv, Lq, Lk, D, dtype, score, causal, adaptive, seed=seed)
    err, ours = run_kernel(hbwd, case, lazy=lazy, seed=seed)
    assert err == "", err
    check_against_reference(case, ours)


def test_hopper_bwd_blhd_layout(hbwd):
    """(B, L, H, D) storage (batch and head strides unrelated): the rank-4 tensor maps' strides."""
    case = Case(2, 4, 2, 90, 130, 64, torch.bfloat16, "ssa", causal=True, seed=8, blhd=True)
    assert case.q.stride()[1] == 64 and not case.q.is_contiguous()
    err, ours = run_kernel(hbwd, case, lazy=True, seed=8)
    assert err == "", err
    check_against_reference(case, ours)


@pytest.mark.parametrize("score,adaptive", [("ssa", False), ("softmax", True)])
def test_hopper_bwd_schedule_independent(hbwd, score, adaptive):
    """dK, dV, db, dn bitwise the same for every copy mode and schedule; dQ (atomics) close."""
    case = Case(1, 2, 1, 150, 140, 64, torch.bfloat16, score, causal=True, adaptive=adaptive, seed=3)
    err, first = run_kernel(hbwd, case, lazy=False, seed=0)
    assert err == "", err
    for lazy, seed in ((True, 0), (False, 99), (True, 1234)):
        err, again = run_kernel(hbwd, case, lazy=lazy, seed=seed)
        assert err == "", err
        for name in first:
            if name == "q":
                torch.testing.assert_close(again[name], first[name], rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(again[name], first[name]), f"d{name} depends on the schedule (lazy={lazy}, seed={seed})"


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("bug,expected", [
    # the producer waits for a stage the consumers never free (3 steps, 2 stages)
    (NO_RELEASE, r"deadlock(.|\n)*waiting on the mbarrier"),
    (WRONG_EMPTY_PARITY, r"deadlock(.|\n)*thread 0: waiting on the mbarrier"),
])
def test_hopper_bwd_bugs_are_reported(hbwd, bug, expected, lazy):
    case = Case(1, 1, 1, 192, 64, 64, torch.bfloat16, "softmax", seed=1)
    err, _ = run_kernel(hbwd, case, lazy=lazy, seed=2, bug=bug)
    assert re.search(expected, err), err


def test_hopper_bwd_races_are_visible(hbwd):
    """A consumer that skips the full barrier's wait reads stages before their loads land: lazily
    performed loads then never land (reported; performed at issue, the emulation's schedule lets
    the producer's loads land before the consumers' next wgmma meets, and hides it); a stage
    released before its GEMMs read it is overwritten by the next load performed at issue (the
    results differ from the correct kernel's)."""
    case = Case(1, 1, 1, 320, 64, 64, torch.bfloat16, "softmax", seed=1)
    err, good = run_kernel(hbwd, case, seed=0)
    assert err == ""
    err, _ = run_kernel(hbwd, case, lazy=True, seed=5, bug=NO_FULL_WAIT)
    # (lazily: the loads never land, and the refill of a stage finds its full barrier's phase open)
    assert re.search(r"TMA loads whose mbarrier phase never completed|mbarrier.arrive.expect_tx: more arrivals", err), err
    for seed in (0, 5):
        err, bad = run_kernel(hbwd, case, lazy=False, seed=seed, bug=EARLY_RELEASE)
        assert err == "" and not all(torch.equal(bad[n], good[n]) for n in good), f"seed {seed}: early release not visible"


def test_hopper_bwd_routing(hbwd):
    """What hopper_bwd_unsupported sends to today's kernels (the one routing decision)."""
    h, dll = hbwd

    def why(case, deterministic=False, **over):
        c, buf, keep = _call(h, dll, case, deterministic)
        for k, v in over.items():
            setattr(c, k, v)
        return dll.hopper_bwd_emu_unsupported(ctypes.byref(c)).decode()

    base = Case(1, 2, 2, 64, 64, 64)
    assert why(base) == ""
    assert why(Case(1, 2, 2, 64, 64, 128, score="ssa")) == ""
    assert "deterministic" in why(base, deterministic=True)
    assert "head dims" in why(Case(1, 2, 2, 64, 64, 32))
    assert "score function" in why(Case(1, 2, 2, 64, 64, 64, score="logit_scale"))
    assert "windows" in why(base, window_left=8)
    assert "soft-capping" in why(base, softcap=5.0)
    assert why(Case(2, 2, 2, 64, 64, 64, blhd=True)) == ""  # any batch / head strides (rank-4 tensor maps)
