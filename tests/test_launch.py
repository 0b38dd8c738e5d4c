"""The Triton launcher's choice of block configuration (ssa_flash/triton/launch.py): tile tables
per kernel and architecture, the autotuner's selection (with a fake kernel and fake timings: no
GPU needed), its fallbacks, and the launch capture the static audit compiles from."""
import pytest
import torch

triton = pytest.importorskip("triton")

from ssa_flash.triton import launch  # noqa: E402


class FakeKernel:
    """Stands in for a JIT function: records launches, fails configurations it is told to."""

    def __init__(self, too_big=()):
        self.too_big = set(too_big)
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, BLOCK_M, BLOCK_N, num_warps=None, num_stages=None, **consts):
            blk = launch.Blocks(BLOCK_M, BLOCK_N, num_warps, num_stages)
            self.calls.append(blk)
            if blk in self.too_big:
                raise triton.runtime.errors.OutOfResources(1, 0, "shared memory")
        return run


@pytest.fixture
def on_fake_gpu(monkeypatch):
    monkeypatch.setattr(launch, "_device_arch", lambda device: 90)
    monkeypatch.setattr(launch, "_chosen_blocks", {})
    monkeypatch.delenv("SSA_FLASH_AUTOTUNE", raising=False)
    return monkeypatch


def _launch(kernel, name="fwd", head_block=64, grid=1000):
    return launch._launch(kernel, name, lambda blk: (grid,), lambda blk: (), {"SSA": True},
                          torch.device("cpu"), head_block, torch.bfloat16)


def test_autotune_picks_the_fastest_and_remembers(on_fake_gpu):
    cands = launch.block_candidates(90, 64, torch.bfloat16, "fwd")
    times = {blk: 1.0 + i for i, blk in enumerate(cands)}
    fastest = cands[2]
    times[fastest] = 0.5
    timed = []

    def fake_timed(run):
        run()
        timed.append(kernel.calls[-1])
        return times[kernel.calls[-1]]

    on_fake_gpu.setattr(launch, "_timed", fake_timed)
    kernel = FakeKernel(too_big=[cands[1]])
    assert _launch(kernel) == fastest
    assert cands[1] not in timed  # did not fit: never timed
    assert kernel.calls[-1] == fastest  # the outputs left behind are the chosen configuration's
    kernel.calls.clear()
    assert _launch(kernel) == fastest  # cached: one launch, no timing
    assert kernel.calls == [fastest]
    # another problem-size bucket is tuned again
    assert _launch(kernel, grid=10) == fastest and len(kernel.calls) > 2


def test_autotune_off_takes_the_first_that_fits(on_fake_gpu):
    on_fake_gpu.setenv("SSA_FLASH_AUTOTUNE", "0")
    on_fake_gpu.setattr(launch, "_timed", lambda run: pytest.fail("timed with autotuning off"))
    cands = launch.block_candidates(90, 128, torch.bfloat16, "bwd_dkdv")
    kernel = FakeKernel(too_big=[cands[0]])
    assert _launch(kernel, "bwd_dkdv", 128) == cands[1]


def test_no_configuration_fits(on_fake_gpu):
    cands = launch.block_candidates(90, 64, torch.bfloat16, "fwd")
    with pytest.raises(RuntimeError, match="no block configuration"):
        _launch(FakeKernel(too_big=cands))


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("kernel", ["fwd", "stats", "bwd_dq", "bwd_dkdv"])
@pytest.mark.parametrize("head_block", [32, 64, 128, 256])
def test_tile_tables(arch, kernel, head_block):
    """Power-of-two tiles; on Hopper, 8 warps only where the wgmma M dimension (queries; keys in
    the transposed dK/dV kernel) covers both warpgroups' 64-row slices."""
    for masked in (False, True):
        for adaptive in (False, True):
            for blk in launch.block_candidates(arch, head_block, torch.bfloat16, kernel, masked, adaptive):
                for size in (blk.m, blk.n):
                    assert size >= 16 and size & (size - 1) == 0
                m_dim = blk.n if kernel == "bwd_dkdv" else blk.m
                if arch >= 90 and blk.warps == 8:
                    assert m_dim >= 128, blk


def test_capture_records_without_running():
    q = torch.empty(2, 4, 300, 64, device="meta", dtype=torch.bfloat16)
    spec = launch.AttentionSpec(scale=0.125, causal=True, group=2, ssa=True, adaptive=False)
    kv = torch.empty(2, 2, 300, 64, device="meta", dtype=torch.bfloat16)
    b = n = torch.empty(4, device="meta")
    with launch.capture_launches(90) as cap:
        launch.forward(q, kv, kv, None, b, n, None, spec)
    (kl,) = cap
    assert kl.name == "fwd" and kl.blocks == launch.block_candidates(90, 64, torch.bfloat16, "fwd")[0]
    assert kl.grid == (triton.cdiv(300, kl.blocks.m) * 2 * 4,)
    assert kl.constexprs["SSA"] and kl.constexprs["CAUSAL"] and kl.constexprs["FAST_MATH"]
    assert kl.constexprs["EVEN_D"]
