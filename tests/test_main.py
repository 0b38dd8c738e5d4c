"""``python -m ssa_flash``: the self-check runs on this machine and fails when it should."""
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ssa_flash import __main__ as selfcheck  # noqa: E402

DEVICE = torch.device("cpu")
CASE = selfcheck.CASES[2]  # GQA + a boolean mask with a fully masked row


def _reference_fn(variant, case):
    def fn(q, k, v, b, n, mask):
        return selfcheck.call_variant(variant, "reference", q, k, v, b, n, mask, case)

    return fn


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(CUDA, reason="CPU path (interpreter); on a GPU bench/run_gpu.sh runs python -m ssa_flash")
def test_main_runs_and_passes_on_cpu():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # __main__ must switch the interpreter on by itself
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
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


@pytest.mark.parametrize("variant", selfcheck.VARIANTS)
def test_check_accepts_the_naive_reference(variant):
    r = selfcheck.check(variant, CASE, torch.float32, DEVICE, "test", fn=_reference_fn(variant, CASE))
    assert r.ok, r


@pytest.mark.parametrize("variant", ["softmax", "ssa_adaptive"])
def test_check_rejects_a_slightly_wrong_output(variant):
    ref = _reference_fn(variant, CASE)

    def wrong(q, k, v, b, n, mask):
        return ref(q, k, v, b, n, mask) * 1.001  # 0.1 % off: far above float32 rounding

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

    def wrong_grad(q, k, v, b, n, mask):
        return ref(Skew.apply(q), k, v, b, n, mask)

    r = selfcheck.check("ssa", CASE, torch.float64, DEVICE, "test", fn=wrong_grad)
    assert not r.ok and r.worst.startswith("dq"), r


def test_check_reports_nan_and_errors_as_failures():
    ref = _reference_fn("softmax", CASE)

    def nan(q, k, v, b, n, mask):
        out = ref(q, k, v, b, n, mask)
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
