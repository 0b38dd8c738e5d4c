"""Direct launches of kept compiled kernels (ssa_flash/triton/direct.py) and the launcher's stub
mode: the specialisation key, when a kept kernel is reused and when a call goes through Triton,
the arguments a direct launch passes, and the fused temperature kernel against its definition."""
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from ssa_flash import temperature  # noqa: E402
from ssa_flash.spec import AttentionSpec  # noqa: E402
from ssa_flash.triton import block_choice, direct, launch, tiles  # noqa: E402


def test_spec_key_keys_what_triton_specialises_on():
    base = torch.zeros(64)
    key = direct.spec_key((base, 1, 16, 17, (base, 2**40), None, 0.5, True))
    assert key == direct.spec_key((torch.ones(64), 1, 16, 17, (torch.ones(64), 2**40), None, 0.5, True))
    # a pointer off 16-byte alignment, another dtype, another integer: other keys
    assert direct.spec_key((base[1:],)) != direct.spec_key((base,))
    assert direct.spec_key((base.half(),)) != direct.spec_key((base,))
    assert direct.spec_key((1,)) != direct.spec_key((2,))
    assert direct.spec_key(((base, 16),)) != direct.spec_key(((base[1:], 16),))
    with pytest.raises(direct.Unspecialisable):
        direct.spec_key(([1, 2],))


def _kernel_fn(X, n, pair, A: tl.constexpr, B: tl.constexpr = 7):
    pass


class FakeCompiled:
    """A compiled kernel's launch surface: records what ``run`` receives."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class FakeJIT:
    """A JIT function: ``kernel[grid](...)`` counts Triton launches and returns one compiled kernel."""

    fn = staticmethod(_kernel_fn)

    def __init__(self):
        self.compiled = FakeCompiled()
        self.jit_calls = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit_calls += 1
            return self.compiled
        return run


@pytest.fixture
def fake_gpu_launcher(monkeypatch):
    launcher = direct.Launcher()
    monkeypatch.setattr(direct, "_current_stream", lambda device: 42)
    monkeypatch.setattr(direct, "_hooks", lambda: (None, None))
    monkeypatch.delenv(direct.ENV, raising=False)
    return launcher


def test_empty_launch_hook_chains_are_passed_as_none(monkeypatch):
    """Triton >= 3.5 keeps an empty HookChain as each launch hook: passing it on would make every
    launch build its launch metadata and call into Python twice for nothing."""
    from triton import knobs

    chain = type("Chain", (), {})()
    chain.calls = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    assert direct._hooks() == (None, None)
    chain.calls = [print]
    assert direct._hooks() == (chain, None)


def test_a_kept_kernel_is_launched_directly(fake_gpu_launcher):
    kernel, gpu = FakeJIT(), torch.device("cuda", 0)
    x = torch.zeros(32)
    args = (x, 5, (x, 16))
    for _ in range(3):
        fake_gpu_launcher.run(kernel, (4, 2), args, {"A": 3}, {"num_warps": 4}, gpu)
    assert kernel.jit_calls == 1  # the first call compiled (through Triton), the others went direct
    assert len(kernel.compiled.runs) == 2
    grid0, grid1, grid2, stream, function, meta, launch_meta, enter, leave, *rest = kernel.compiled.runs[0]
    assert (grid0, grid1, grid2, stream, function, meta) == (4, 2, 1, 42, "function", "metadata")
    assert launch_meta is None and enter is None and leave is None
    assert tuple(rest[:3]) == args and rest[3:] == [3, 7]  # every argument, constexprs (defaults too) last
    # another specialisation (a misaligned pointer, other constexprs): through Triton again
    fake_gpu_launcher.run(kernel, (4,), (x[1:], 5, (x, 16)), {"A": 3}, {"num_warps": 4}, gpu)
    fake_gpu_launcher.run(kernel, (4,), args, {"A": 4}, {"num_warps": 4}, gpu)
    assert kernel.jit_calls == 3


def test_direct_launches_can_be_turned_off(fake_gpu_launcher, monkeypatch):
    monkeypatch.setenv(direct.ENV, "0")
    kernel = FakeJIT()
    for _ in range(3):
        fake_gpu_launcher.run(kernel, (1,), (torch.zeros(4), 1, (1, 2)), {"A": 1}, {}, torch.device("cuda", 0))
    assert kernel.jit_calls == 3 and not kernel.compiled.runs


def test_a_stand_in_that_is_no_compiled_kernel_is_never_kept(fake_gpu_launcher):
    calls = []

    class StandIn:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(1)

    for _ in range(3):
        fake_gpu_launcher.run(StandIn(), (1,), (1,), {}, {}, torch.device("cuda", 0))
    assert len(calls) == 3


def test_stub_mode_plans_as_on_a_gpu_and_launches_nothing(monkeypatch):
    """Under ``direct.stub`` the launcher chooses sm_90 tiles and keeps its choice, the kernels
    never run (their outputs stay as allocated), and leaving the mode forgets the stubs."""
    class Refusing:
        fn = getattr(launch.attention_fwd_kernel, "fn", launch.attention_fwd_kernel)

        def __getitem__(self, grid):
            raise AssertionError("a kernel ran in stub mode")

    monkeypatch.setattr(block_choice, "chosen_blocks", {})
    monkeypatch.setattr(launch, "attention_fwd_kernel", Refusing())
    q = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    spec = AttentionSpec(scale=0.125, causal=True)
    with direct.stub(90):
        for _ in range(2):
            out, lse = launch.forward(q, q, q, None, (), None, spec)
        assert out.shape == q.shape and lse.shape == q.shape[:-1]
        chosen = [blk for key, blk in block_choice.chosen_blocks.items() if key[0] == "fwd"]
        assert chosen and chosen[0] == tiles.block_candidates(90, 64, torch.float16, "fwd")[0]
        assert direct.LAUNCHER._kept
    assert not direct.LAUNCHER._kept and direct.stub_arch() is None


@pytest.mark.parametrize("poly,threshold", [(temperature.DEFAULT_POLY, 0.5), ((2.0,), 0.0), ((0.5, 1.0), 1.0)])
def test_fused_temperature_matches_its_definition(poly, threshold):
    from ssa_flash.triton import block_choice, temperature as fused, tiles
    from ssa_flash.triton.interpreter import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ent = torch.linspace(0.0, 6.0, 1500, device=device).reshape(3, 500)
    beta, dbeta = fused.beta_from_entropy(ent, poly, threshold)
    ref_beta, ref_dbeta = temperature.beta_from_entropy(ent, poly, threshold)
    gold_beta, gold_dbeta = temperature.beta_from_entropy(ent.double(), poly, threshold)
    # FlashAttention's rule against the float64 definition: the kernel's Horner form (FMAs on a
    # GPU) and torch's float32 ops round differently, and the default polynomial cancels (its terms
    # reach ~100 where beta is ~1-2.4), so neither is the other's reference (H200: 7e-6 apart)
    near_switch = ((gold_beta - 1.0).abs() < 1e-5) & (ent.double() > threshold)  # beta = max(p, 1) may flip
    for name, ours, naive, gold in (("beta", beta, ref_beta, gold_beta), ("dbeta", dbeta, ref_dbeta, gold_dbeta)):
        ours_err = (ours.double() - gold).abs().masked_fill(near_switch, 0).max().item()
        naive_err = (naive.double() - gold).abs().masked_fill(near_switch, 0).max().item()
        floor = 1e-6 * max(1.0, gold.abs().max().item())
        assert ours_err <= 2 * naive_err + floor, (name, ours_err, naive_err)


def test_keys_follow_the_layout_of_the_arguments(fake_gpu_launcher):
    """Keys are worked out along where the tensors are (once per specialisation); a tensor where a
    value was goes through Triton rather than being keyed by identity."""
    x = torch.zeros(32)
    layout = direct._layout((x, 3, (1, 2), (x, 4), None))
    assert layout == (True, None, None, (True, None), None)
    assert direct._keyed((x, 3, (1, 2), (x, 4), None), layout) == \
        direct.spec_key((x, 3, (1, 2), (x, 4), None))
    with pytest.raises(ValueError):
        direct._keyed((x, x, (1, 2), (x, 4), None), layout)
    kernel = FakeJIT()
    gpu = torch.device("cuda", 0)
    fake_gpu_launcher.run(kernel, (1,), (x, 1, (x, 2)), {"A": 1}, {}, gpu)
    fake_gpu_launcher.run(kernel, (1,), (x, x, (x, 2)), {"A": 1}, {}, gpu)
    assert kernel.jit_calls == 2 and not kernel.compiled.runs


def test_a_failing_direct_launch_falls_back_to_triton(fake_gpu_launcher, monkeypatch, caplog):
    """Should a Triton's launch convention differ, the first direct launch fails, the call goes
    through Triton, and direct launches stay off for the process."""
    monkeypatch.setattr(direct, "_broken", None)
    kernel = FakeJIT()

    def refuse(*args):
        raise TypeError("function takes 14 positional arguments")

    kernel.compiled.run = refuse
    gpu, args = torch.device("cuda", 0), (torch.zeros(4), 1, (1, 2))
    with caplog.at_level("WARNING", logger="ssa_flash"):
        for _ in range(3):
            fake_gpu_launcher.run(kernel, (1,), args, {"A": 1}, {}, gpu)
    assert kernel.jit_calls == 3 and not direct.enabled()
    assert "direct launches of compiled Triton kernels are off" in caplog.text


def test_kept_kernels_are_per_device(fake_gpu_launcher):
    """A compiled kernel is loaded into one device's context: another device's first launch goes
    through Triton (which loads it there)."""
    kernel, x = FakeJIT(), torch.zeros(8)
    for device in ("cuda:0", "cuda:1", "cuda:0", "cuda:1"):
        fake_gpu_launcher.run(kernel, (1,), (x, 3, (1, 2)), {"A": 1}, {}, torch.device(device))
    assert kernel.jit_calls == 2 and len(kernel.compiled.runs) == 2
