"""csrc/pipeline.h (warp-specialised sm_90a primitives) through tests/cuda/ws_probe.cuh, a
producer warpgroup loading tiles by TMA through a 2-stage mbarrier ring and two consumer
warpgroups taking turns (named barriers) at wgmma:

1. In the CPU emulation (csrc/emu; the probe built with the host compiler): S = Q K^T, its row
   sums and the consumers' issue order against torch, TMA loads performed at issue or as late as
   the mbarrier allows, under shuffled schedules, with fewer, as many and more K tiles than
   stages and ragged ends (TMA's zero fill); the results bitwise the same in every mode and
   schedule. Broken variants (a consumer that never frees its stage, a producer waiting on the
   wrong parity, warps of a warpgroup with different setmaxnreg counts, a shuffle reached by
   half a warp, disagreeing barrier counts, an uninitialised mbarrier, a misaligned swizzled TMA
   destination) are reported as errors, not hangs; a race (a stage freed before its wgmma read
   it) gives wrong results.
2. Compiled with nvcc for sm_90a: the SASS has the TMA loads (UTMALDG, 2-D and 3-D) and the
   descriptor prefetch, the mbarrier operations (SYNCS), wgmma (HGMMA), setmaxnreg with the
   roles' budgets (USETMAXREG), elect.sync and the named barriers (BAR.ARV / BAR.SYNC), and
   ptxas reports no spills and no stack.

Skipped without the CUDA headers / a host compiler (1) or nvcc / cuobjdump (2).
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import background
from emulation import build_test_library

pytestmark = pytest.mark.slow  # (builds; like test_csrc_compile's emulation tests)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CSRC = ROOT / "csrc"
NVCC = shutil.which("nvcc")
(OK, NO_EMPTY_ARRIVE, WRONG_EMPTY_PARITY, SPLIT_SETMAXNREG, DIVERGENT_SHFL, EARLY_RELEASE, BARRIER_COUNTS,
 UNINITIALISED_MBAR, MISALIGNED_TMA) = range(9)  # ws_probe.cuh, ProbeBug
D, BM, BN = 128, 128, 64


def _build_emu():
    """(library path, None) or (None, why)."""
    return build_test_library(HERE / "ws_probe_emu.cpp", background.tmpdir("ws_probe_emu"), "libws_probe.so")


def _build_cubin():
    """(cubin path, ptxas -v output, SASS text), or None without nvcc / cuobjdump."""
    if NVCC is None:
        return None
    try:
        from ssa_flash.audit.compile import tool

        cuobjdump = tool("cuobjdump")
    except (ImportError, FileNotFoundError):
        return None
    out = background.tmpdir("ws_probe_sm90a") / "ws_probe.cubin"
    proc = subprocess.run([NVCC, "-arch=sm_90a", "-cubin", "-std=c++17", "-Xptxas", "-v", "-I", str(CSRC),
                           str(HERE / "ws_probe.cu"), "-o", str(out)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{proc.stdout}{proc.stderr}")
    sass = subprocess.run([cuobjdump, "-sass", str(out)], capture_output=True, text=True, check=True).stdout
    return out, proc.stdout + proc.stderr, sass


def prebuild(items):
    names = {f for item in items for f in item.fixturenames}
    if "probe" in names:
        background.submit("ws_probe.emu", _build_emu)
    if "cubin" in names:
        background.submit("ws_probe.sm90a", _build_cubin)


@pytest.fixture(scope="module")
def probe():
    lib, why = background.submit("ws_probe.emu", _build_emu).result()
    if lib is None:
        pytest.skip(why)
    dll = ctypes.CDLL(str(lib))
    dll.ws_probe_run.restype = ctypes.c_char_p
    dll.ws_probe_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return dll


@pytest.fixture(scope="module")
def cubin():
    built = background.submit("ws_probe.sm90a", _build_cubin).result()
    if built is None:
        pytest.skip("nvcc or cuobjdump not found")
    return built


def _inputs(lq, lk, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(lq, D, generator=g).to(torch.bfloat16)
    k = torch.randn(lk, D, generator=g).to(torch.bfloat16)
    return q, k


def _run(probe, q, k, bug=OK, lazy=False, seed=1, k_rank=2):
    """(error or "", S (128 x 64 n), row sums (128), issue order (2 n))."""
    n = -(-k.shape[0] // BN)
    s = torch.full((BM, BN * n), float("nan"))
    rowsum = torch.full((BM,), float("nan"))
    order = torch.full((2 * n,), -1, dtype=torch.int32)
    err = probe.ws_probe_run(q.data_ptr(), q.shape[0], k.data_ptr(), k.shape[0], k_rank, bug, int(lazy), seed,
                             s.data_ptr(), rowsum.data_ptr(), order.data_ptr())
    return err.decode(), s, rowsum, order


# (lq, lk, lazy, seed, k_rank): one K tile (fewer than the stages), as many, more with a ragged
# end, many; seed 0 runs the threads in order, others shuffle them; K by 2-D loads (one per
# 64-column panel) or one 3-D load
CASES = [(128, 64, False, 0, 2), (128, 128, True, 5, 3), (100, 300, False, 7, 2), (77, 330, True, 3, 3),
         (128, 512, True, 11, 2)]


@pytest.mark.parametrize("lq,lk,lazy,seed,k_rank", CASES)
def test_probe_matches_torch(probe, lq, lk, lazy, seed, k_rank):
    q, k = _inputs(lq, lk, seed=lk)
    err, s, rowsum, order = _run(probe, q, k, lazy=lazy, seed=seed, k_rank=k_rank)
    assert err == ""
    n = -(-lk // BN)
    ref = torch.zeros(BM, BN * n, dtype=torch.float64)  # rows past lq and columns past lk: TMA's zeros
    ref[:lq, :lk] = q.double() @ k.double().T
    torch.testing.assert_close(s.double(), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(s[lq:], torch.zeros_like(s[lq:])) and torch.equal(s[:, lk:], torch.zeros_like(s[:, lk:]))
    torch.testing.assert_close(rowsum.double(), ref.sum(1), rtol=1e-5, atol=1e-3)
    assert order.tolist() == [0, 1] * n, "the consumers did not take turns"


def test_probe_schedule_independent(probe):
    """Eager or lazy TMA loads, threads in order or shuffled: bitwise the same results."""
    q, k = _inputs(128, 330)
    first = _run(probe, q, k, lazy=False, seed=0)
    assert first[0] == ""
    for lazy, seed, k_rank in ((True, 0, 2), (False, 99, 3), (True, 1234, 2)):
        again = _run(probe, q, k, lazy=lazy, seed=seed, k_rank=k_rank)
        assert again[0] == ""
        for a, b in zip(first[1:], again[1:]):
            assert torch.equal(a, b), f"lazy={lazy} seed={seed} k_rank={k_rank}: results depend on the schedule"


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("bug,lk,expected", [
    # the producer waits for a stage the consumers never free (3 tiles, 2 stages)
    (NO_EMPTY_ARRIVE, 192, r"deadlock(.|\n)*thread 0: waiting on the mbarrier at shared 0x[0-9a-f]+ for the phase of parity 0"),
    # the producer waits for the empty barrier's phase 0 before anyone can complete it
    (WRONG_EMPTY_PARITY, 128, r"deadlock(.|\n)*thread 0: waiting on the mbarrier(.|\n)*threads 128-383: waiting on the mbarrier"),
    (SPLIT_SETMAXNREG, 64, r"warpgroup 0 not uniform: .*setmaxnreg\.dec 24.*setmaxnreg\.dec 32"),
    (DIVERGENT_SHFL, 64, r"collective reached divergently: warp \d+: lane \d+ .*(finished|at shfl)"),
    (BARRIER_COUNTS, 64, r"barrier 1 used with different counts"),
    (UNINITIALISED_MBAR, 64, r"mbarrier\.arrive\.expect_tx: no mbarrier initialised at shared 0x"),
    (MISALIGNED_TMA, 64, r"cp\.async\.bulk\.tensor destination: shared address 0x[0-9a-f]+ not 1024-byte aligned"),
])
def test_probe_bugs_are_reported(probe, bug, lk, expected, lazy):
    q, k = _inputs(128, lk)
    err, *_ = _run(probe, q, k, bug=bug, lazy=lazy, seed=2)
    assert re.search(expected, err), err


def test_probe_sass(cubin):
    """The device build: every primitive is there as the instruction it should be, no local memory."""
    _, ptxas, sass = cubin
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", ptxas), ptxas
    ops = re.findall(r"\b([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_x]+)*)\b", sass)
    opcodes = {op.split(".")[0] for op in ops}
    for op in ("UTMALDG", "SYNCS", "HGMMA", "USETMAXREG", "ELECT"):
        assert op in opcodes, f"{op} not in the SASS"
    full = set(ops)
    assert any(o.startswith("SYNCS.ARRIVE.TRANS64") for o in full), "no mbarrier arrive"
    assert any(o.startswith("SYNCS.PHASECHK") for o in full), "no mbarrier wait"
    # the register budgets: producer 24 (0x18) given back, consumers 240 (0xf0) taken
    assert re.search(r"USETMAXREG\.DEALLOC\S* 0x18\b", sass) and re.search(r"USETMAXREG\.TRY_ALLOC\S* \w+, 0xf0\b", sass)
    assert any(o.startswith("UTMALDG.2D") for o in full) and any(o.startswith("UTMALDG.3D") for o in full)
    assert any(o.startswith("UTMACCTL.PF") for o in full), "no tensor-map prefetch"
    assert any(o.startswith("BAR.ARV") for o in full) and any(o.startswith("BAR.SYNC") for o in full)
    assert any(o.startswith("HGMMA.64x64x16.F32.BF16") for o in full)
    assert not {"LDL", "STL"} & opcodes, "local memory in the probe"


def test_probe_early_release_is_a_visible_race(probe):
    """Consumers that free a stage as soon as it is full (before their wgmma read it): TMA loads
    performed at issue land in the freed stage before the wgmma reads it, and S is wrong (lazily
    performed loads land only when their phase is waited for, after the wgmma, and hide the race:
    hence both modes in the tests above)."""
    q, k = _inputs(128, 512)
    good = _run(probe, q, k, seed=0)[1]
    for seed in (0, 5):
        err, s, *_ = _run(probe, q, k, bug=EARLY_RELEASE, lazy=False, seed=seed)
        assert err == "" and not torch.equal(s, good), f"seed {seed}: the emulation did not show the early release"
