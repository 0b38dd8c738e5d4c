"""The Triton launcher's choice of block configuration (ssa_flash/triton/launch.py): tile tables
per kernel and architecture, the autotuner's selection (with a fake kernel and fake timings: no
GPU needed), its fallbacks, and the launch capture the static audit compiles from."""
import pytest
import torch

triton = pytest.importorskip("triton")

from ssa_flash import scores  # noqa: E402
from ssa_flash.triton import block_choice, kernel_args, launch, tiles, tuning_cache  # noqa: E402


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
def on_fake_gpu(monkeypatch, tmp_path):
    """A pretend sm_90 GPU named "Fake GPU", an empty in-memory choice table and a tuning cache
    in a fresh folder."""
    monkeypatch.setattr(block_choice, "device_arch", lambda device: 90)
    monkeypatch.setattr(tuning_cache, "gpu_name", lambda device: "Fake GPU")
    monkeypatch.setattr(block_choice, "chosen_blocks", {})
    monkeypatch.setenv("SSA_FLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SSA_FLASH_AUTOTUNE", raising=False)
    return monkeypatch


def _launch(kernel, name="fwd", head_block=64, grid=1000, deterministic=False):
    return block_choice.launch_kernel(kernel, name, lambda blk: (grid,), lambda blk: (), {"SCORE": scores.SSA.id},
                          torch.device("cpu"), head_block, torch.bfloat16, deterministic)


def _prefer_last(on_fake_gpu, kernel, cands):
    """A fake timer under which the last candidate is the fastest; returns the list of the
    configurations it timed."""
    timed = []

    def fake_timed(run):
        run()
        timed.append(kernel.calls[-1])
        return 1.0 / (1 + cands.index(kernel.calls[-1]))

    on_fake_gpu.setattr(block_choice, "timed", fake_timed)
    return timed


def _no_timing(on_fake_gpu):
    on_fake_gpu.setattr(block_choice, "timed", lambda run: pytest.fail("timed a configuration"))


def test_autotune_picks_the_fastest_and_remembers(on_fake_gpu):
    cands = tiles.block_candidates(90, 64, torch.bfloat16, "fwd")
    times = {blk: 1.0 + i for i, blk in enumerate(cands)}
    fastest = cands[2]
    times[fastest] = 0.5
    timed = []

    def fake_timed(run):
        run()
        timed.append(kernel.calls[-1])
        return times[kernel.calls[-1]]

    on_fake_gpu.setattr(block_choice, "timed", fake_timed)
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
    on_fake_gpu.setattr(block_choice, "timed", lambda run: pytest.fail("timed with autotuning off"))
    cands = tiles.block_candidates(90, 128, torch.bfloat16, "bwd_dkdv")
    kernel = FakeKernel(too_big=[cands[0]])
    assert _launch(kernel, "bwd_dkdv", 128) == cands[1]


def test_no_configuration_fits(on_fake_gpu):
    cands = tiles.block_candidates(90, 64, torch.bfloat16, "fwd")
    with pytest.raises(RuntimeError, match="no block configuration.*OutOfResources"):
        _launch(FakeKernel(too_big=cands))


def test_a_compile_error_of_every_configuration_says_its_cause(on_fake_gpu):
    """A kernel's tl.static_assert fails in every configuration (on an H200 the score-function
    guard's message was lost behind "no block configuration fits"): the error names the cause."""
    from triton.compiler.errors import CompilationError

    class Failing(FakeKernel):
        def __getitem__(self, grid):
            def run(*args, **consts):
                raise CompilationError("", None, "ssa_flash: the Triton kernels have no maths for this score function id")
            return run

    with pytest.raises(RuntimeError, match="(?s)no block configuration.*no maths for this score function id"):
        _launch(Failing())


# --- deterministic=True: a fixed configuration, never timed ---------------------------------------


def test_deterministic_takes_the_first_that_fits_untimed(on_fake_gpu):
    cands = tiles.block_candidates(90, 64, torch.bfloat16, "fwd")
    assert len(set(cands)) > 2
    kernel = FakeKernel()
    timed = _prefer_last(on_fake_gpu, kernel, cands)
    # the default tunes: the fake timer's favourite
    assert _launch(kernel) == cands[-1] and timed
    # deterministic ignores that remembered (in memory and on disk) timed choice
    timed.clear()
    kernel.calls.clear()
    assert _launch(kernel, deterministic=True) == cands[0]
    assert not timed and kernel.calls == [cands[0]]
    # a configuration that does not build is skipped, still without timing
    on_fake_gpu.setattr(block_choice, "chosen_blocks", {})
    kernel = FakeKernel(too_big=[cands[0]])
    timed = _prefer_last(on_fake_gpu, kernel, cands)
    assert _launch(kernel, deterministic=True) == cands[1] and not timed


def test_deterministic_reaches_every_launch(on_fake_gpu):
    """The launcher takes the backends' one spec type (nothing to convert, so ``deterministic``
    reaches it as given), and with ``deterministic`` every kernel launch of the forward, the
    statistics and the backward runs its first candidate untimed."""
    from ssa_flash import spec as bspec

    assert launch.AttentionSpec is bspec.AttentionSpec and launch.TemperatureState is bspec.TemperatureState
    _no_timing(on_fake_gpu)
    kernels = {}
    for attr in ("attention_fwd_kernel", "row_entropy_kernel", "attention_bwd_dq_kernel",
                 "attention_bwd_dkdv_kernel"):
        kernels[attr] = FakeKernel()
        on_fake_gpu.setattr(launch, attr, kernels[attr])
    q = torch.zeros(1, 2, 40, 64, dtype=torch.bfloat16)
    b = n = torch.ones(2)
    spec = launch.AttentionSpec(scale=0.125, causal=True, group=1, adaptive=False, deterministic=True, score="ssa")
    o, lse = launch.forward(q, q, q, None, (b, n), None, spec)
    launch.row_entropy(q, q, None, (b, n), spec)
    launch.backward(o, q, q, q, o, lse, None, None, (b, n), None, spec)
    for attr, name in (("attention_fwd_kernel", "fwd"), ("row_entropy_kernel", "row_entropy"),
                       ("attention_bwd_dq_kernel", "bwd_dq"), ("attention_bwd_dkdv_kernel", "bwd_dkdv")):
        first = tiles.block_candidates(90, 64, torch.bfloat16, name)[0]
        assert kernels[attr].calls == [first], attr


# --- the tuning cache on disk -----------------------------------------------------------------------


def test_tuned_choice_is_read_back_by_another_process(on_fake_gpu, tmp_path):
    cands = tiles.block_candidates(90, 64, torch.bfloat16, "fwd")
    kernel = FakeKernel()
    _prefer_last(on_fake_gpu, kernel, cands)
    assert _launch(kernel) == cands[-1]
    files = list((tmp_path / "cache" / "autotune").iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"  # no temporary file left behind
    # "another process": nothing in memory; the choice comes from disk, one launch, no timing
    on_fake_gpu.setattr(block_choice, "chosen_blocks", {})
    _no_timing(on_fake_gpu)
    kernel.calls.clear()
    assert _launch(kernel) == cands[-1] and kernel.calls == [cands[-1]]
    # another GPU model does not read it
    on_fake_gpu.setattr(block_choice, "chosen_blocks", {})
    on_fake_gpu.setattr(tuning_cache, "gpu_name", lambda device: "Other GPU")
    timed = _prefer_last(on_fake_gpu, kernel, cands)
    _launch(kernel)
    assert timed


def test_cache_key_names_what_decides_the_choice(on_fake_gpu):
    from ssa_flash import __version__

    cands = tiles.block_candidates(90, 64, torch.bfloat16, "fwd")
    key = tuning_cache.cache_key(launch.attention_fwd_kernel, "fwd", torch.device("cpu"), 64, torch.bfloat16, 1024,
                            {"SCORE": scores.SSA.id}, cands)
    for part in ("Fake GPU", torch.__version__, triton.__version__, __version__, "attention_fwd_kernel", "1024"):
        assert part in key
    other = tuning_cache.cache_key(launch.attention_fwd_kernel, "fwd", torch.device("cpu"), 64, torch.bfloat16, 1024,
                              {"SCORE": scores.SOFTMAX.id}, cands)
    assert tuning_cache.cache_path(key) != tuning_cache.cache_path(other)


def test_cache_key_names_a_compiled_kernel(on_fake_gpu):
    """The key names the kernel by :func:`tuning_cache.kernel_identity` of its source closure, not by
    Triton's ``cache_key`` (which differed between two machines for the same sources)."""
    class Compiled:
        fn = getattr(launch.attention_fwd_kernel, "fn", launch.attention_fwd_kernel)
        cache_key = "0123456789abcdef"

    cands = tiles.block_candidates(90, 64, torch.bfloat16, "fwd")
    key = tuning_cache.cache_key(Compiled(), "fwd", torch.device("cpu"), 64, torch.bfloat16, 1024, {}, cands)
    assert "kernel=attention_fwd_kernel:" in key and "0123456789abcdef" not in key
    assert f"kernel={tuning_cache.kernel_identity(launch.attention_fwd_kernel)}\n" in key


_KERNEL_MODULE = """
import triton
import triton.language as tl

SCALE = tl.constexpr({scale})


@triton.jit
def helper(x):
    return x * {factor}
{padding}

@triton.jit
def unrelated(x):
    return x + {other}


@triton.jit
def kernel(X):
    tl.store(X, helper(tl.load(X)) * SCALE)
"""


def _identity_of(tmp_path, tag, scale=2, factor=3, other=1, padding=""):
    """``_kernel_identity`` of ``kernel`` in a fresh module written from ``_KERNEL_MODULE``."""
    import importlib.util

    path = tmp_path / f"identity_{tag}.py"
    path.write_text(_KERNEL_MODULE.format(scale=scale, factor=factor, other=other, padding=padding))
    spec = importlib.util.spec_from_file_location("identity_kernels", path)  # one module name
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    identity = tuning_cache.kernel_identity(module.kernel)
    assert identity.startswith("kernel:")
    return identity.split(":", 1)[1]


def test_kernel_identity_follows_the_code_the_kernel_reaches(tmp_path):
    base = _identity_of(tmp_path, "base")
    assert _identity_of(tmp_path, "again") == base  # the same sources read again
    assert _identity_of(tmp_path, "other", other=5) == base  # a function the kernel does not call
    assert _identity_of(tmp_path, "shifted", padding="\n\n\n") == base  # line numbers only
    assert _identity_of(tmp_path, "helper", factor=4) != base  # a JIT function it calls
    assert _identity_of(tmp_path, "constexpr", scale=5) != base  # a tl.constexpr global it reads


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign", "not_a_candidate"])
def test_a_damaged_cache_file_is_ignored(on_fake_gpu, damage):
    cands = tiles.block_candidates(90, 64, torch.bfloat16, "fwd")
    kernel = FakeKernel()
    _prefer_last(on_fake_gpu, kernel, cands)
    _launch(kernel)
    (path,) = tuning_cache.cache_dir().iterdir()
    text = path.read_text()
    path.write_text({"garbage": "\x00not json{", "truncated": text[: len(text) // 2],
                     "foreign": text.replace('"key": "', '"key": "x'),
                     "not_a_candidate": text.replace('"blocks": [', '"blocks": [3, ')}[damage])
    on_fake_gpu.setattr(block_choice, "chosen_blocks", {})
    timed = _prefer_last(on_fake_gpu, kernel, cands)
    assert _launch(kernel) == cands[-1] and timed  # tuned again, and the file mended
    on_fake_gpu.setattr(block_choice, "chosen_blocks", {})
    _no_timing(on_fake_gpu)
    assert _launch(kernel) == cands[-1]


def test_an_unwritable_cache_does_not_break_a_call(on_fake_gpu, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    on_fake_gpu.setenv("SSA_FLASH_CACHE_DIR", str(blocker / "cache"))  # cannot be created
    cands = tiles.block_candidates(90, 64, torch.bfloat16, "fwd")
    kernel = FakeKernel()
    _prefer_last(on_fake_gpu, kernel, cands)
    assert _launch(kernel) == cands[-1]
    assert _launch(kernel) == cands[-1]  # remembered in memory


def test_a_stale_cached_choice_that_no_longer_builds_falls_back(on_fake_gpu):
    cands = tiles.block_candidates(90, 64, torch.bfloat16, "fwd")
    kernel = FakeKernel()
    _prefer_last(on_fake_gpu, kernel, cands)
    _launch(kernel)
    on_fake_gpu.setattr(block_choice, "chosen_blocks", {})
    _no_timing(on_fake_gpu)
    assert _launch(FakeKernel(too_big=[cands[-1]])) == cands[0]


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("SSA_FLASH_CACHE_DIR", str(tmp_path))
    assert tuning_cache.cache_dir() == tmp_path / "autotune"
    monkeypatch.delenv("SSA_FLASH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning_cache.cache_dir() == tmp_path / "xdg" / "ssa_flash" / "autotune"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning_cache.cache_dir() == tmp_path / "home" / ".cache" / "ssa_flash" / "autotune"


# --- candidates that cannot be built, slow tuning -------------------------------------------------


def _compile_error(cls):
    err = cls.__new__(cls)  # the constructors' signatures differ between Triton versions
    Exception.__init__(err, "cannot build")
    return err


@pytest.mark.parametrize("error", ["OutOfResources", "PTXASError", "CompilationError",
                                   "CompileTimeAssertionFailure"])
def test_a_candidate_that_does_not_build_is_skipped(on_fake_gpu, error):
    import triton.compiler.errors
    import triton.runtime.errors

    cls = getattr(triton.runtime.errors, error, None) or getattr(triton.compiler.errors, error)
    assert issubclass(cls, block_choice.COMPILE_ERRORS)
    cands = tiles.block_candidates(90, 64, torch.bfloat16, "fwd")

    class Failing(FakeKernel):
        def __getitem__(self, grid):
            run = super().__getitem__(grid)

            def failing(*args, **kw):
                run(*args, **kw)
                if self.calls[-1] == cands[0]:
                    raise _compile_error(cls)
            return failing

    kernel = Failing()
    timed = _prefer_last(on_fake_gpu, kernel, cands)
    assert _launch(kernel) == cands[-1] and cands[0] not in timed
    on_fake_gpu.setattr(block_choice, "chosen_blocks", {})
    assert _launch(kernel, deterministic=True) == cands[1]


def test_other_errors_are_not_swallowed(on_fake_gpu):
    class Broken(FakeKernel):
        def __getitem__(self, grid):
            def run(*args, **kw):
                raise TypeError("a bug, not a configuration that does not fit")
            return run

    with pytest.raises(TypeError, match="a bug"):
        _launch(Broken())


def test_slow_tuning_logs_one_line(on_fake_gpu, caplog):
    cands = tiles.block_candidates(90, 64, torch.bfloat16, "fwd")
    kernel = FakeKernel()
    _prefer_last(on_fake_gpu, kernel, cands)
    on_fake_gpu.setattr(block_choice, "_SLOW_TUNING_S", 1e9)
    with caplog.at_level("INFO", logger="ssa_flash"):
        _launch(kernel, grid=1000)
    assert not [r for r in caplog.records if r.name == "ssa_flash"]
    on_fake_gpu.setattr(block_choice, "_SLOW_TUNING_S", 0.0)
    with caplog.at_level("INFO", logger="ssa_flash"):
        _launch(kernel, grid=10)  # another size bucket: tuned again
    (rec,) = [r for r in caplog.records if r.name == "ssa_flash"]
    msg = rec.getMessage()
    assert "\n" not in msg and "fwd" in msg and str(tuning_cache.cache_dir()) in msg and "SSA_FLASH_AUTOTUNE" in msg


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("kernel", ["fwd", "row_entropy", "bwd_dq", "bwd_dkdv"])
@pytest.mark.parametrize("head_block", [32, 64, 128, 256])
def test_tile_tables(arch, kernel, head_block):
    """Power-of-two tiles; on Hopper, 8 warps only where the wgmma M dimension (queries; keys in
    the transposed dK/dV kernel) covers both warpgroups' 64-row slices."""
    for masked in (False, True):
        for adaptive in (False, True):
            for blk in tiles.block_candidates(arch, head_block, torch.bfloat16, kernel, masked, adaptive):
                for size in (blk.m, blk.n):
                    assert size >= 16 and size & (size - 1) == 0
                m_dim = blk.n if kernel == "bwd_dkdv" else blk.m
                if arch >= 90 and blk.warps == 8:
                    assert m_dim >= 128, blk


def test_capture_records_without_running():
    q = torch.empty(2, 4, 300, 64, device="meta", dtype=torch.bfloat16)
    spec = launch.AttentionSpec(scale=0.125, causal=True, group=2, adaptive=False, score="ssa")
    kv = torch.empty(2, 2, 300, 64, device="meta", dtype=torch.bfloat16)
    b = n = torch.empty(4, device="meta")
    with launch.capture_launches(90) as cap:
        launch.forward(q, kv, kv, None, (b, n), None, spec)
    (kl,) = cap
    assert kl.name == "fwd" and kl.blocks == tiles.block_candidates(90, 64, torch.bfloat16, "fwd")[0]
    assert kl.grid == (triton.cdiv(300, kl.blocks.m) * 2 * 4,)
    assert kl.constexprs["SCORE"] == scores.SSA.id and kl.constexprs["CAUSAL"] and kl.constexprs["FAST_MATH"]
    assert kl.constexprs["EVEN_D"]


@pytest.mark.parametrize("arch", [80, 90])
def test_boolean_masks_get_no_16_wide_tiles_on_a_gpu(arch):
    """A kernel reading a boolean mask's bytes miscompiled at 16-wide tiles (H200, Triton 3.6:
    wrong out, dQ and dK at 16 x 16, right at 32 x 32 and with an additive mask): on a GPU such
    launches are offered no configuration with a 16-wide side; additive masks keep them (float32
    halves its tiles to 16 in the tables)."""
    q = torch.empty(1, 2, 300, 16, device="meta", dtype=torch.float32)
    b = n = torch.empty(2, device="meta")
    spec = launch.AttentionSpec(scale=0.25, causal=False, group=1, adaptive=False, score="ssa")
    kinds = {}
    for name, mask in (("bool", torch.empty(300, 300, device="meta", dtype=torch.bool)),
                       ("additive", torch.empty(300, 300, device="meta", dtype=torch.float32))):
        with launch.capture_launches(arch) as cap:
            launch.forward(q, q, q, mask.expand(1, 2, 300, 300), (b, n), None, spec)
        (kl,) = cap
        kinds[name] = kl.candidates
    assert kinds["bool"] and all(min(c.m, c.n) > 16 for c in kinds["bool"])
    assert any(min(c.m, c.n) == 16 for c in kinds["additive"])


@pytest.mark.parametrize("d,dv", [(111, 111), (59, 64), (64, 30)])
def test_unaligned_head_dims_are_padded(d, dv):
    """Head dims that are not a multiple of 8 reach the kernels zero-padded to one (16-byte rows:
    vector loads, no spills, static audit), forward and backward; results come back at the
    caller's sizes, contiguous. The padding itself is checked numerically by the kernel tests
    (D = 59, 111 against the reference)."""
    q = torch.empty(1, 2, 40, d, device="meta", dtype=torch.float16)
    k = torch.empty(1, 2, 40, d, device="meta", dtype=torch.float16)
    v = torch.empty(1, 2, 40, dv, device="meta", dtype=torch.float16)
    spec = launch.AttentionSpec(scale=0.1, causal=False, group=1, adaptive=False)
    with launch.capture_launches(90) as cap:
        o, lse = launch.forward(q, k, v, None, (), None, spec)
        grads = launch.backward(torch.empty_like(o), q, k, v, o, lse, None, None, (), None, spec)
    assert o.shape == (1, 2, 40, dv) and o.is_contiguous()
    assert [g.shape[-1] for g in grads[:3]] == [d, d, dv] and all(g.is_contiguous() for g in grads[:3])
    assert [kl.name for kl in cap] == ["fwd", "bwd_dq", "bwd_dkdv"]
    for kl in cap:
        tensors = [a for a in kl.args if isinstance(a, torch.Tensor) and a.dim() == 4]
        assert tensors and all(t.shape[-1] % 8 == 0 and t.stride(2) % 8 == 0 for t in tensors), kl.name


def test_kernel_strides_are_one_argument_per_tensor():
    """Each tensor's strides reach the attention kernels as one tuple argument ``<name>_strides``
    (Triton >= 3.3 takes tuples), not one parameter per axis; a capture passes them as tuples of
    ints, with a contiguous tensor's unit last stride among them (Triton specialises it as it
    would a scalar 1)."""
    for kernel, names in kernel_args.PARAMS.items():
        assert not [n for n in names if n.startswith("stride_")], kernel
        assert {"q_strides", "k_strides"} <= set(names), kernel
    q = torch.empty(1, 2, 40, 64, device="meta", dtype=torch.float16)
    spec = launch.AttentionSpec(scale=0.1, causal=False, group=1, adaptive=False)
    with launch.capture_launches(90) as cap:
        launch.forward(q, q, q, None, (), None, spec)
    (kl,) = cap
    strides = kl.args[kernel_args.PARAMS["fwd"].index("q_strides")]
    assert strides == tuple(q.stride()) and strides[-1] == 1


def test_kernel_signatures_are_short():
    """No attention kernel takes more than 25 runtime parameters: related ones travel as tuples
    (the problem's sizes, strides, per-row statistics, feature parameters)."""
    assert {kernel: len(names) for kernel, names in kernel_args.PARAMS.items() if len(names) > 25} == {}


def test_launch_arguments_are_named():
    """Launch sites name the kernels' arguments: the positional tuple follows each kernel's
    signature, and a misspelt or missing name is a TypeError naming it."""
    names = kernel_args.PARAMS["row_entropy"]
    args = kernel_args.positional("row_entropy", **{n: i for i, n in enumerate(reversed(names))})
    assert args == tuple(reversed(range(len(names))))
    full = {n: 0 for n in names}
    with pytest.raises(TypeError, match="stride_qx"):
        kernel_args.positional("row_entropy", **full, stride_qx=1)
    del full["window"]
    with pytest.raises(TypeError, match="window"):
        kernel_args.positional("row_entropy", **full)
    # every runtime parameter, none of the constexprs
    assert "Q" in names and "BLOCK_M" not in names and "VARLEN" not in names
