"""The host path: the eager path (ssa_flash.autograd's autograd.Function calling the backends)
computes what the custom ops compute, bit for bit; the host-path benchmark runs on the CPU with
stubbed launches; on a GPU, no call synchronises the device and every variant replays from a CUDA
graph and under torch.compile(mode="reduce-overhead")."""
import pytest
import torch

import ssa_flash
from ssa_flash import autograd as ssa_autograd
from ssa_flash.bench import host

from attn_testing import CUDA, make_qkv, needs_cuda, needs_kernels

VARIANTS = {"softmax": {}, "ssa": {"ssa": True}, "adaptive": {"adaptive_temperature": True},
            "ssa_adaptive": {"ssa": True, "adaptive_temperature": True}}


def _call(q, k, v, variant, b=None, n=None, **kw):
    opts = dict(VARIANTS[variant])
    ssa = opts.pop("ssa", False)
    if ssa:
        return ssa_flash.ssa_attention(q, k, v, b=b, n=n, **opts, **kw)
    return ssa_flash.softmax_attention(q, k, v, **kw) if not opts else \
        ssa_flash.adaptive_temperature_attention(q, k, v, **kw)


def _run(variant, through_ops, monkeypatch, **kw):
    monkeypatch.setattr(ssa_autograd, "_through_ops", lambda *t: through_ops)
    torch.manual_seed(0)
    dtype = torch.float32 if CUDA else torch.float64
    q, k, v = make_qkv(B=1, Hq=2, Hkv=2, Lq=24, D=16, dtype=dtype, device="cuda" if CUDA else "cpu", seed=0)
    b = torch.full((2,), 0.8, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=q.device)
    b, n = b.requires_grad_(), (b.detach() + 0.7).requires_grad_()
    out, lse = _call(q, k, v, variant, b, n, backend="triton", return_lse=True, **kw)
    (out.sum() + lse.sum()).backward()
    kind = type(out.grad_fn).__name__
    grads = [t.grad for t in (q, k, v)] + ([b.grad, n.grad] if VARIANTS[variant].get("ssa") else [])
    return kind, [out, lse, *grads]


@needs_kernels
@pytest.mark.parametrize("variant,kw", [("ssa_adaptive", {"is_causal": True}),
                                        ("softmax", {"dropout_p": 0.3, "window_size": (5, 3)})])
def test_eager_path_equals_the_ops(variant, kw, monkeypatch):
    kind_ops, through_ops = _run(variant, True, monkeypatch, **kw)
    kind_eager, eager = _run(variant, False, monkeypatch, **kw)
    assert "EagerAttention" in kind_eager and "EagerAttention" not in kind_ops
    for a, b in zip(through_ops, eager):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@needs_kernels
def test_dispatch_modes_and_subclasses_go_through_the_ops():
    q = torch.zeros(1, 2, 8, 8)
    assert not ssa_autograd._through_ops(q)
    assert ssa_autograd._through_ops(torch.nn.Parameter(q))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        assert ssa_autograd._through_ops(q)


def test_host_benchmark_runs_on_the_cpu(tmp_path):
    if CUDA:
        pytest.skip("the GPU host benchmark runs in bench/run_gpu.sh")
    from ssa_flash.triton.interpreter import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    res = host.run(str(tmp_path), reps=3, ops=("ssa", "adaptive"), features=("plain", "varlen", "kvcache"),
                   quiet=True)
    rows = res["rows"]
    impls = {(r["impl"], r["feature"], r["pass"]) for r in rows}
    assert ("sdpa", "plain", "fwd") in impls and ("ssa_flash.triton", "kvcache", "fwd") in impls
    assert ("ssa_flash.cuda", "plain", "fwd_bwd") in impls  # over the stub extension
    assert all(r["host_us"] and r["host_us"] > 0 for r in rows), [r for r in rows if not r["host_us"]]
    assert all(r["ratio_to_sdpa"] > 0 for r in rows if r["impl"] != "sdpa")
    assert res["path"].endswith("-host.json") and (tmp_path / res["path"].split("/")[-1]).exists()


def test_host_benchmark_profile(tmp_path):
    """``--host-profile``: a cProfile per backend of the plain softmax calls, before the rows, with
    our own functions among the top ones (the path shortened to the package)."""
    if CUDA:
        pytest.skip("the GPU host benchmark runs in bench/run_gpu.sh")
    from ssa_flash.triton.interpreter import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    res = host.run(str(tmp_path), reps=2, ops=("softmax",), features=("plain",), quiet=True, profile=True,
                   split=False)
    labels = set(res["profile"])
    assert {"ssa_flash.triton softmax plain fwd", "ssa_flash.cuda softmax plain fwd_bwd"} <= labels, labels
    text = res["profile"]["ssa_flash.triton softmax plain fwd"]
    # (a planned call's launches: ssa_flash/triton/prepared.py)
    assert "function calls" in text and "ssa_flash/triton/" in text, text[:2000]


# --------------------------------------------------------------------------------------------
# On a GPU

FEATURES = {"plain": {"is_causal": True}, "mask": {"attn_mask": "tril"}, "dropout": {"dropout_p": 0.2},
            "window": {"is_causal": True, "window_size": (16, -1)}}


def _gpu_backends():
    return [b for b in ("triton", "cuda") if b in ssa_flash.available_backends("cuda")]


@needs_cuda
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_host_device_synchronisation(variant, feature):
    """Forward and backward of every variant and feature under torch's sync debug mode set to
    error: any synchronising call on the path raises."""
    q, k, v = make_qkv(B=2, Hq=4, Hkv=4, Lq=128, D=64, dtype=torch.float16, device="cuda", seed=1)
    b = torch.full((4,), 1.0, device="cuda", requires_grad=True)
    n = torch.full((4,), 1.5, device="cuda", requires_grad=True)
    kw = dict(FEATURES[feature])
    if kw.get("attn_mask") == "tril":
        kw["attn_mask"] = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril()
    for backend in _gpu_backends():
        for _ in range(2):  # the first call compiles and tunes (which synchronises by design)
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = _call(q, k, v, variant, b, n, backend=backend, **kw)
                out.backward(torch.ones_like(out))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


@needs_cuda
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_reduce_overhead_compile(variant):
    """torch.compile(mode="reduce-overhead") (CUDA graphs under the compiler) of a forward and
    backward, replayed on fresh inputs, matches eager."""
    for backend in _gpu_backends():
        q, k, v = make_qkv(B=1, Hq=2, Hkv=2, Lq=64, D=32, dtype=torch.float16, device="cuda", seed=2)

        def step(q, k, v):
            return _call(q, k, v, variant, 1.0, 1.5, is_causal=True, backend=backend)

        compiled = torch.compile(step, mode="reduce-overhead")
        for seed in range(3):
            q, k, v = (t.detach() + 0.01 * seed for t in (q, k, v))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = compiled(*leaves)
            out.backward(torch.ones_like(out))
            ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = step(*ref_leaves)
            ref.backward(torch.ones_like(ref))
            torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
            for a, r in zip(leaves, ref_leaves):
                torch.testing.assert_close(a.grad, r.grad, atol=2e-3, rtol=2e-3)


def test_host_benchmark_baseline_is_sdpa_in_float32_on_the_cpu(monkeypatch):
    """On the CPU SDPA's baseline runs on float32 tensors (its float16 CPU kernels would hide its
    host cost behind compute), whatever the rows after it use."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append(q.dtype) or real(q, k, v, **kw))
    rows = host.cases("cpu", torch.float16, 1, 2, 16, 8, backends=(), features=("plain", "mask"))
    for case in rows:
        assert case.impl == "sdpa"
        case.fn()
    assert seen and set(seen) == {torch.float32}


def test_host_benchmark_counts_python_calls():
    """Every row reports the Python function calls of one call beside its time; the count sees a
    Python function added to the path (so a count within the budget is not a count of nothing)."""
    calls = host.python_calls(lambda: None)
    assert calls == 0

    def two():
        (lambda: None)()
        (lambda: None)()

    assert host.python_calls(two) == 2
    if CUDA:
        pytest.skip("the GPU host benchmark runs in bench/run_gpu.sh")
    from ssa_flash.triton.interpreter import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    res = host.run(None, reps=2, ops=("softmax",), features=("plain",), quiet=True, split=False)
    assert all(isinstance(r["python_calls"], int) and r["python_calls"] > 0 for r in res["rows"])
    assert "calls" in host.render(res)


def test_plain_rows_within_the_call_budget():
    """The plain rows (every variant, both backends, forward and forward + backward) within
    ``host.CALL_LIMITS``, counted in stub mode as ``python -m ssa_flash.bench --host`` does."""
    if CUDA:
        pytest.skip("counted in stub mode on the CPU")
    from ssa_flash.triton.interpreter import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    over = []
    with host.stubbed_launches():
        for case in host.cases(torch.device("cpu"), torch.float16, 1, 2, 64, 16, ops=host.OPS, features=("plain",)):
            if case.impl != "sdpa":
                n = host.python_calls(case.fn)
                if n > host.CALL_LIMITS[case.pass_]:
                    over.append(f"{case.impl} {case.op} {case.pass_}: {n}")
    assert not over, over
