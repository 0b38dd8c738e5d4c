"""The per-family tile tables (ssa_flash/triton/tiles.py): every family's first choice fits its
shared memory by the estimate, for every kernel, head dim and feature switch; the launcher prunes
configurations that cannot fit before compiling them. The compiled side (no spills, the compiler's
shared memory) is gated by tests/audit/test_audit.py."""
import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

from ssa_flash.audit import model  # noqa: E402
from ssa_flash import scores  # noqa: E402
from ssa_flash.triton import block_choice, launch, tiles  # noqa: E402

KERNELS = ("fwd", "row_entropy", "bwd_dq", "bwd_dkdv")
HEAD_BLOCKS = (16, 32, 64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# a representative compute capability of each family, and the others that belong to it
MEMBERS = {75: (75,), 80: (80, 87), 86: (86, 89), 90: (90,), 100: (100, 103), 120: (120, 121)}


def test_family_mapping_and_limits():
    for fam, archs in MEMBERS.items():
        for arch in archs:
            assert tiles.family(arch) == fam
            assert tiles.smem_limit(arch) == tiles.FAMILY_SMEM[fam]
    # the audit's architecture model states the same per-block budgets
    for fam in tiles.FAMILIES:
        assert tiles.FAMILY_SMEM[fam] == model.arch_model(fam).smem_per_block, fam


@pytest.mark.parametrize("arch", [75, 80, 86, 89, 90, 100, 120])
def test_first_choice_fits_the_family(arch):
    """For every kernel, head dim, dtype and switch (mask, adaptive, dropout, window), and the
    decoding table: the first choice's estimated shared memory is within the family's budget
    (the old tables handed sm_120 Hopper's 128 x 64 x 3 forward, 128 KB, and sm_86 a 112 KB
    dK/dV at D = 256)."""
    limit = tiles.smem_limit(arch)
    for kernel, hb, dtype, masked, adaptive, dropout, window in itertools.product(
            KERNELS, HEAD_BLOCKS, DTYPES, *([(False, True)] * 4)):
        first = tiles.block_candidates(arch, hb, dtype, kernel, masked, adaptive, dropout, window)[0]
        est = tiles.estimate_smem(first, kernel, hb, dtype, arch)
        if hb > 128 and not tiles.fits(tiles.Blocks(16, 16, 4, 1), kernel, hb, dtype, arch):
            continue  # sm_75, float32, D = 256 backward: no tile fits 64 KB; compiling decides
        assert est <= limit, (arch, kernel, hb, dtype, masked, adaptive, dropout, window, first, est)
    for hb, dtype in itertools.product(HEAD_BLOCKS, DTYPES):
        first = tiles.decode_candidates(arch, hb, dtype)[0]
        assert tiles.estimate_smem(first, "fwd_decode", hb, dtype, arch) <= limit, (arch, hb, dtype, first)


@pytest.mark.parametrize("arch", [75, 80, 86, 90, 100, 120])
def test_tables_are_well_formed(arch):
    """Power-of-two tiles of at least 16; on wgmma / tcgen05 targets 8 warps only with M >= 128
    for 16-bit inputs (float32's halved tiles keep 8 warps: TF32 splits N over the warpgroups);
    every list ends in configurations small enough for any family."""
    for kernel, hb, dtype, masked, adaptive, dropout in itertools.product(
            KERNELS, HEAD_BLOCKS, DTYPES, *([(False, True)] * 3)):
        cands = tiles.block_candidates(arch, hb, dtype, kernel, masked, adaptive, dropout)
        for blk in cands:
            for size in (blk.m, blk.n):
                assert size >= 16 and size & (size - 1) == 0, blk
            m_dim = blk.n if kernel == "bwd_dkdv" else blk.m
            if arch in (90, 100) and blk.warps == 8 and dtype != torch.float32:
                assert m_dim >= 128, (kernel, hb, blk)
        if tiles.fits(tiles.Blocks(16, 16, 4, 1), kernel, hb, dtype, 75):
            assert any(tiles.fits(b, kernel, hb, dtype, 75) for b in cands), (kernel, hb, dtype)


def test_estimate_grows_with_tiles_stages_and_dtype():
    base = tiles.Blocks(64, 64, 4, 2)
    for kernel in KERNELS:
        for arch in (80, 90):
            e = tiles.estimate_smem(base, kernel, 64, torch.bfloat16, arch)
            assert tiles.estimate_smem(base, kernel, 64, torch.float32, arch) == 2 * e
            assert tiles.estimate_smem(tiles.Blocks(64, 64, 4, 3), kernel, 64, torch.bfloat16, arch) > e
            assert tiles.estimate_smem(base, kernel, 128, torch.bfloat16, arch) > e
    # wgmma reads operands from shared memory: one more buffer than mma.sync's cp.async pipeline
    assert (tiles.estimate_smem(base, "fwd", 64, torch.bfloat16, 90)
            > tiles.estimate_smem(base, "fwd", 64, torch.bfloat16, 80))


class RecordingKernel:
    """Stands in for a JIT function: records every configuration it is asked to run."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, BLOCK_M, BLOCK_N, num_warps=None, num_stages=None, **consts):
            self.calls.append(launch.Blocks(BLOCK_M, BLOCK_N, num_warps, num_stages))
        return run


@pytest.mark.parametrize("arch", [75, 86, 120])
def test_launcher_never_compiles_what_cannot_fit(monkeypatch, arch):
    """On a small-memory GPU the configurations whose estimate exceeds the family's budget never
    reach the kernel (compiling them would only end in OutOfResources), with and without the
    autotuner."""
    huge = tiles.Blocks(128, 128, 8, 4)  # 128 KB of K/V buffers alone at D = 64
    small = tiles.Blocks(32, 32, 4, 2)
    assert not tiles.fits(huge, "fwd", 64, torch.bfloat16, arch) and tiles.fits(small, "fwd", 64, torch.bfloat16, arch)
    monkeypatch.setattr(block_choice, "device_arch", lambda device: arch)
    monkeypatch.setattr(block_choice, "chosen_blocks", {})
    monkeypatch.setattr(tiles, "block_candidates", lambda *a, **k: [huge, small, huge])
    monkeypatch.setattr(block_choice, "timed", lambda run: (run(), 1.0)[1])
    for tune in ("0", "1"):
        monkeypatch.setenv("SSA_FLASH_AUTOTUNE", tune)
        block_choice.chosen_blocks.clear()
        kernel = RecordingKernel()
        chosen = block_choice.launch_kernel(kernel, "fwd", lambda blk: (64,), lambda blk: (), {"SCORE": scores.SOFTMAX.id},
                                torch.device("cpu"), 64, torch.bfloat16)
        assert chosen == small
        assert kernel.calls and huge not in kernel.calls


def test_capture_records_the_pruned_candidates():
    """The launch the audit compiles lists only what the launcher would try on that family."""
    q = torch.empty(2, 4, 256, 256, device="meta", dtype=torch.float32)
    spec = launch.AttentionSpec(scale=0.1, causal=False, group=1, adaptive=False)
    for arch in (75, 86):
        with launch.capture_launches(arch) as cap:
            launch.forward(q, q, q, None, (), None, spec)
        (kl,) = cap
        assert kl.candidates and all(tiles.fits(b, "fwd", 256, torch.float32, arch) for b in kl.candidates)
        assert kl.blocks == kl.candidates[0]
