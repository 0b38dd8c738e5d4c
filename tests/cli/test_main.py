"""``python -m ssa_flash``: the self-check runs on this machine and fails when it should."""
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from ssa_flash import selfcheck  # noqa: E402

DEVICE = torch.device("cpu")
CASE = selfcheck.CASES[2]  # GQA + a boolean mask with a fully masked row


def _reference_fn(variant, case):
    def fn(q, k, v, params, mask):
        return selfcheck.call_variant(variant, "reference", q, k, v, params, mask, case)

    return fn


CUDA = torch.cuda.is_available()


def _cli_env() -> dict:
    """A subprocess environment for ``python -m ssa_flash`` on the CPU: this checkout first on the
    path, no GPU, and no TRITON_INTERPRET (the CLI must switch the interpreter on by itself)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.skipif(CUDA, reason="CPU path (interpreter); on a GPU bench/run_gpu.sh runs python -m ssa_flash")
def test_main_runs_and_passes_on_cpu():
    env = _cli_env()
    proc = subprocess.run([sys.executable, "-m", "ssa_flash"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert "kernel backends here: triton" in out
    n = len(selfcheck.VARIANTS) * len(selfcheck.CASES) * 2
    assert f"{n} of {n} checks passed" in out
    assert len(re.findall(r"^triton\s+float(32|64)\s.*\sok$", out, flags=re.M)) == n
    assert "Triton interpreter" in out and "ssa_flash.triton" in out  # the labelled timing table
    assert out.rstrip().splitlines()[-1].startswith("OK")


@pytest.mark.skipif(CUDA, reason="CPU path (interpreter); on a GPU bench/run_gpu.sh runs python -m ssa_flash")
def test_main_worker_processes_find_their_function():
    """``python -m ssa_flash --jobs 2`` (the default on a GPU: up to 8): the spawned workers unpickle
    the checks' function by module name. It failed every check on an H200 (2026-11-28) while it
    lived in the package's ``__main__``, which a spawned child does not re-import."""
    env = _cli_env()
    proc = subprocess.run([sys.executable, "-m", "ssa_flash", "--jobs", "2", "--no-timing"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    n = len(selfcheck.VARIANTS) * len(selfcheck.CASES) * 2
    assert f"{n} of {n} checks passed" in out


@pytest.mark.parametrize("variant", selfcheck.VARIANTS)
def test_check_accepts_the_naive_reference(variant):
    r = selfcheck.check(variant, CASE, torch.float32, DEVICE, "test", fn=_reference_fn(variant, CASE))
    assert r.ok, r


@pytest.mark.parametrize("variant", ["softmax", "ssa_adaptive"])
def test_check_rejects_a_slightly_wrong_output(variant):
    ref = _reference_fn(variant, CASE)

    def wrong(q, k, v, params, mask):
        return ref(q, k, v, params, mask) * 1.001  # 0.1 % off: far above float32 rounding

    r = selfcheck.check(variant, CASE, torch.float32, DEVICE, "test", fn=wrong)
    assert not r.ok and r.worst.startswith(("out", "d")), r


def test_check_rejects_a_wrong_gradient_only():
    ref = _reference_fn("ssa", CASE)

    class Skew(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 1.01

    def wrong_grad(q, k, v, params, mask):
        return ref(Skew.apply(q), k, v, params, mask)

    r = selfcheck.check("ssa", CASE, torch.float64, DEVICE, "test", fn=wrong_grad)
    assert not r.ok and r.worst.startswith("dq"), r


def test_check_reports_nan_and_errors_as_failures():
    ref = _reference_fn("softmax", CASE)

    def nan(q, k, v, params, mask):
        out = ref(q, k, v, params, mask)
        return out + torch.where(torch.arange(out.numel()).view(out.shape) == 5, float("nan"), 0.0)

    assert not selfcheck.check("softmax", CASE, torch.float32, DEVICE, "test", fn=nan).ok

    def boom(*args):
        raise RuntimeError("kernel exploded")

    r = selfcheck.check("softmax", CASE, torch.float32, DEVICE, "test", fn=boom)
    assert not r.ok and "kernel exploded" in r.detail


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_check_passes_on_cuda(dtype):
    import ssa_flash

    for backend in [b for b in ssa_flash.available_backends("cuda") if b != "reference"]:
        for variant in ("ssa", "ssa_adaptive"):
            r = selfcheck.check(variant, selfcheck.CASES[1], dtype, torch.device("cuda"), backend)
            assert r.ok, r


# ------------------------------------------------------------------------------------------------
# Backends that take some dtypes only, and a CUDA extension not built yet (CPU, faked availability)


@pytest.fixture
def fake_cuda(monkeypatch):
    """The CUDA backend made available on the CPU, refusing float32 as the real one does, computing
    through the reference backend, with an extension that is not built yet: ``state`` counts the
    load_extension() calls (``load_calls``); ``state["fail"]`` makes it raise."""
    import ssa_flash
    from ssa_flash.backends import cuda_backend
    from ssa_flash.backends import reference_backend as ref_backend
    from ssa_flash.errors import BackendUnavailableError

    state = {"built": False, "load_calls": 0, "fail": None}

    def supports(q, k, v, spec):
        if q.dtype == torch.float32:
            return f"the CUDA kernels take float16 or bfloat16 inputs, got {q.dtype}"
        return None

    def load_extension():
        state["load_calls"] += 1
        if state["fail"]:
            raise BackendUnavailableError(state["fail"])
        state["built"] = True
        return object()

    monkeypatch.setattr(cuda_backend, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(cuda_backend, "supports", supports)
    monkeypatch.setattr(cuda_backend, "ready", lambda: state["built"])
    monkeypatch.setattr(cuda_backend, "load_extension", load_extension)
    for fn in ("forward", "backward", "row_entropy"):
        monkeypatch.setattr(cuda_backend, fn, getattr(ref_backend, fn))
    # no prepared calls (the real backend's launches) and no call plans from other tests' calls
    monkeypatch.setattr(cuda_backend, "prepare", lambda *args: None)
    ssa_flash.ops._call_plans.clear()
    # only this backend (the Triton interpreter is slow), one case
    monkeypatch.setattr(ssa_flash, "available_backends", lambda device: ("cuda", "reference"))
    monkeypatch.setattr(selfcheck, "CASES", (CASE,))
    threads = torch.get_num_threads()  # main() sets 1 for its tiny CPU ops
    yield state
    torch.set_num_threads(threads)
    ssa_flash.ops._call_plans.clear()


def test_self_check_runs_only_the_dtypes_a_backend_supports(fake_cuda, capsys):
    assert selfcheck.main(["--no-timing", "--cpu"]) == 0
    out = capsys.readouterr().out
    n = len(selfcheck.VARIANTS)
    # float32 refused by supports(): one skipped line with the backend's reason, no FAIL
    assert re.search(r"^cuda\s+float32\s.*skipped\s+the CUDA kernels take float16 or bfloat16", out, flags=re.M), out
    assert "FAIL" not in out
    assert len(re.findall(r"^cuda\s+float64\s.*\sok$", out, flags=re.M)) == n
    assert f"{n} of {n} checks passed" in out and f"{n} skipped" in out
    # the build was announced and timed, before the checks
    assert fake_cuda["load_calls"] == 1
    assert re.search(r"building the CUDA extension \(first use, may take minutes.*\n"
                     r"built the CUDA extension in \d+ s", out), out
    assert out.index("built the CUDA extension") < out.index("checks passed")
    assert out.rstrip().splitlines()[-1].startswith("OK")


def test_self_check_does_not_announce_loading_a_built_extension(fake_cuda, capsys):
    fake_cuda["built"] = True
    assert selfcheck.main(["--no-timing", "--cpu"]) == 0
    assert fake_cuda["load_calls"] == 1  # load_extension(): an import, nothing built
    out = capsys.readouterr().out
    assert "building the CUDA extension" not in out and "not checked" not in out


@pytest.fixture
def fake_triton(monkeypatch):
    """A second kernel backend next to the fake CUDA one: "triton" computing through the reference
    backend (the interpreter is slow)."""
    import ssa_flash
    from ssa_flash.backends import reference_backend as ref_backend
    from ssa_flash.backends import triton_backend

    for fn in ("forward", "backward", "row_entropy"):
        monkeypatch.setattr(triton_backend, fn, getattr(ref_backend, fn))
    monkeypatch.setattr(triton_backend, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(ssa_flash, "available_backends", lambda device: ("triton", "cuda", "reference"))


def test_self_check_no_build_cuda_skips_the_unbuilt_backend(fake_cuda, fake_triton, capsys):
    assert selfcheck.main(["--no-timing", "--cpu", "--no-build-cuda"]) == 0
    out = capsys.readouterr().out
    assert fake_cuda["load_calls"] == 0 and "building the CUDA extension" not in out
    assert "not checked: backend 'cuda': the CUDA extension is not built (--no-build-cuda)" in out
    assert not re.search(r"^cuda\s", out, flags=re.M)
    n = 2 * len(selfcheck.VARIANTS)
    assert len(re.findall(r"^triton\s+float(32|64)\s.*\sok$", out, flags=re.M)) == n


def test_self_check_reports_a_failed_build_without_failing(fake_cuda, fake_triton, capsys):
    fake_cuda["fail"] = "the CUDA extension ssa_flash._C is not built and its JIT build failed: nvcc mismatch"
    assert selfcheck.main(["--no-timing", "--cpu"]) == 0
    out = capsys.readouterr().out
    assert fake_cuda["load_calls"] == 1
    assert "the CUDA extension build failed after" in out
    assert "not checked: backend 'cuda': the CUDA extension ssa_flash._C is not built and its JIT build failed" in out
    assert not re.search(r"^cuda\s", out, flags=re.M)  # no check line for it
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("OK") and "backend 'cuda' not checked: " in last


def test_support_reason_asks_the_backend_with_the_checked_inputs(monkeypatch):
    from ssa_flash.backends import cuda_backend

    seen = []

    def supports(q, k, v, spec):
        seen.append((q.dtype, q.shape, k.shape, spec.causal, spec.group, spec.adaptive))
        return None

    monkeypatch.setattr(cuda_backend, "supports", supports)
    case = selfcheck.CASES[1]
    assert selfcheck.support_reason("cuda", "ssa_adaptive", case, torch.float16, DEVICE) is None
    assert seen == [(torch.float16, (case.batch, case.hq, case.lq, case.d), (case.batch, case.hkv, case.lk, case.d),
                     case.causal, case.hq // case.hkv, True)]
    # the real backend refuses float32 (and, without a GPU, the CPU device): a reason, not None
    monkeypatch.undo()
    assert selfcheck.support_reason("cuda", "softmax", case, torch.float32, DEVICE)


def test_checks_take_the_first_block_configuration(monkeypatch):
    """The self-check's checks run without block-size timing (SSA_FLASH_AUTOTUNE=0 inside, gone
    after); a user's own setting is kept as it is."""
    monkeypatch.delenv("SSA_FLASH_AUTOTUNE", raising=False)
    with selfcheck.first_block_configuration():
        assert os.environ["SSA_FLASH_AUTOTUNE"] == "0"
    assert "SSA_FLASH_AUTOTUNE" not in os.environ
    monkeypatch.setenv("SSA_FLASH_AUTOTUNE", "1")
    with selfcheck.first_block_configuration():
        assert os.environ["SSA_FLASH_AUTOTUNE"] == "1"
    assert os.environ["SSA_FLASH_AUTOTUNE"] == "1"


def test_self_check_groups_run_in_worker_processes():
    """jobs > 1: each (backend, dtype, variant) group in a spawned process, every check reported."""
    results = selfcheck.self_check(torch.device("cpu"), ["reference"], [torch.float64], jobs=2)
    assert len(results) == len(selfcheck.CASES) * len(selfcheck.VARIANTS)
    assert all(r.ok and not r.skipped for r in results), [r for r in results if not r.ok]
    assert {(r.variant, r.case) for r in results} == {(v, c.name) for v in selfcheck.VARIANTS for c in selfcheck.CASES}


def test_self_check_backends_option(fake_cuda, fake_triton, capsys):
    """--backends cuda: the CUDA backend's checks only; an absent backend is an error."""
    fake_cuda["built"] = True
    assert selfcheck.main(["--no-timing", "--cpu", "--backends", "cuda"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^cuda\s", out, flags=re.M) and not re.search(r"^triton\s", out, flags=re.M)
    assert selfcheck.main(["--no-timing", "--cpu", "--backends", "nope"]) == 1
    assert "backend(s) nope not available here" in capsys.readouterr().out


def test_pin_arch_list_narrows_to_the_device(monkeypatch, capsys):
    from ssa_flash.backends import _cuda_build

    assert _cuda_build.device_arch_list([(9, 0), (8, 0), (9, 0)]) == "8.0;9.0a"
    assert _cuda_build.arch_count("7.5;8.0 8.6;8.9+PTX;9.0a") == 5
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;8.6;9.0")
    assert selfcheck.pin_arch_list() == "9.0a"
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a"
    assert "narrowed to '9.0a'" in capsys.readouterr().out
