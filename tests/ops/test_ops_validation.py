"""Bad input gets a clear ValueError / TypeError naming the argument (docs/design.md §2), before any
kernel runs; backends that cannot run say why."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ssa_flash
from attn_testing import DEVICE


def qkv(B=1, H=2, L=8, D=16, dtype=torch.float32):
    return tuple(torch.randn(B, H, L, D, dtype=dtype, device=DEVICE) for _ in range(3))


FNS = [ssa_flash.ssa_attention, ssa_flash.softmax_attention, ssa_flash.adaptive_temperature_attention]


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_shape_errors(fn, backend):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="query must have at least 2 dims"):
        fn(q[0, 0, 0], k, v, backend=backend)
    with pytest.raises(ValueError, match="head dim"):
        fn(q, k[..., :8], v, backend=backend)
    with pytest.raises(ValueError, match="batch"):  # 2 and 3 do not broadcast (1 and 2 would: SDPA's rule)
        fn(torch.cat([q, q]), torch.cat([k, k, k]), torch.cat([v, v, v]), backend=backend)
    with pytest.raises(ValueError, match="key .* and value"):
        fn(q, k, v[:, :, :5], backend=backend)
    q3 = torch.randn(1, 3, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="enable_gqa"):  # 3 query heads, 2 key heads (1 would broadcast)
        fn(q3, k, v, backend=backend)
    with pytest.raises(ValueError, match="multiple"):
        fn(q3, k, v, enable_gqa=True, backend=backend)


@pytest.mark.parametrize("fn", FNS)
def test_type_errors(fn):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="query"):
        fn(q.numpy() if DEVICE == "cpu" else [1.0], k, v)
    with pytest.raises(TypeError, match="share a dtype"):
        fn(q, k.double(), v)
    with pytest.raises(TypeError, match="key"):
        fn(q, k.to(torch.int32), v)
    with pytest.raises(TypeError, match="attn_mask"):
        fn(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="attn_mask"):
        fn(q, k, v, attn_mask="causal")
    with pytest.raises(TypeError, match="is_causal"):
        fn(q, k, v, is_causal=1)
    with pytest.raises(TypeError, match="backend"):
        fn(q, k, v, backend=None)
    with pytest.raises(TypeError, match="scale"):
        fn(q, k, v, scale="0.5")


@pytest.mark.parametrize("fn", FNS)
def test_value_errors(fn):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="attn_mask"):
        fn(q, k, v, attn_mask=torch.ones(3, 8, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="attn_mask"):
        fn(q, k, v, attn_mask=torch.ones(1, 1, 1, 1, 8, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="backend"):
        fn(q, k, v, backend="tpu")
    with pytest.raises(ValueError, match="dropout_p"):
        fn(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match="scale"):
        fn(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="window_size"):
        fn(q, k, v, window_size=(-2, 3))


def test_b_n_errors():
    q, k, v = qkv(H=2)
    f = ssa_flash.ssa_attention
    for name in ("b", "n"):
        with pytest.raises(ValueError, match=f"{name} must be"):
            f(q, k, v, **{name: -1.0})
        if name == "b":  # n = 0 is in n's domain (uniform weights): test_n_zero_one_rule
            with pytest.raises(ValueError, match=f"{name} must be"):
                f(q, k, v, **{name: 0.0})
        with pytest.raises(ValueError, match=f"{name} must be"):
            f(q, k, v, **{name: float("inf")})
        with pytest.raises(ValueError, match=name):
            f(q, k, v, **{name: torch.ones(3, device=DEVICE)})
        with pytest.raises(ValueError, match=name):
            f(q, k, v, **{name: torch.ones(2, 1, device=DEVICE)})
        with pytest.raises(TypeError, match=name):
            f(q, k, v, **{name: torch.ones(2, dtype=torch.int64, device=DEVICE)})
        with pytest.raises(TypeError, match=name):
            f(q, k, v, **{name: "1.0"})
    if DEVICE == "cpu":  # CPU tensors are checked by value (no device synchronisation needed)
        with pytest.raises(ValueError, match="b must be"):
            f(q, k, v, b=torch.tensor([1.0, -2.0]))


def test_poly_errors():
    q, k, v = qkv()
    f = ssa_flash.adaptive_temperature_attention
    with pytest.raises(TypeError, match="poly"):
        f(q, k, v, poly=[])
    with pytest.raises(TypeError, match="poly"):
        f(q, k, v, poly="abc")
    with pytest.raises(ValueError, match="poly"):
        f(q, k, v, poly=[1.0, float("nan")])
    with pytest.raises(TypeError, match="threshold"):
        f(q, k, v, threshold=None)


def test_mask_requiring_grad_gets_a_gradient_of_its_own_shape():
    """A learned additive mask (tests/ops/test_mask_grad.py has the gradient checks): the default
    backend differentiates it, broadcast dims summed."""
    q, k, v = qkv()
    mask = torch.zeros(8, 8, device=DEVICE, requires_grad=True)
    ssa_flash.ssa_attention(q, k, v, attn_mask=mask).square().sum().backward()
    assert mask.grad is not None and mask.grad.shape == (8, 8) and bool(mask.grad.abs().sum() > 0)


def test_head_dim_limit():
    q, k, v = qkv(D=264)
    if "triton" not in ssa_flash.available_backends(DEVICE):
        pytest.skip("Triton backend not available here")
    with pytest.raises(ValueError, match="256"):
        ssa_flash.ssa_attention(q, k, v, backend="triton")


def test_unavailable_backend_says_why():
    q, k, v = qkv()
    if "cuda" in ssa_flash.available_backends(DEVICE):
        pytest.skip("the CUDA backend is available here")
    with pytest.raises(ssa_flash.BackendUnavailableError, match="cuda"):
        ssa_flash.ssa_attention(q, k, v, backend="cuda")
    # usable as ValueError (a bad backend argument) and RuntimeError (a missing capability)
    assert issubclass(ssa_flash.BackendUnavailableError, ValueError)
    assert issubclass(ssa_flash.BackendUnavailableError, RuntimeError)


def test_triton_on_cpu_without_interpreter_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (t.cpu() for t in qkv())
    with pytest.raises(ssa_flash.BackendUnavailableError, match="TRITON_INTERPRET"):
        ssa_flash.ssa_attention(q, k, v, backend="triton")


def test_auto_backend_on_cpu():
    backends = ssa_flash.available_backends("cpu")
    assert backends[-1] == "reference"
    q, k, v = (t.cpu() for t in qkv())
    out = ssa_flash.ssa_attention(q, k, v)  # runs whichever CPU backend is available
    torch.testing.assert_close(out, ssa_flash.reference.attention(q, k, v, score="ssa", score_params=(1.0, 1.5)),
                               atol=1e-5, rtol=1e-5)


def test_validation_does_not_synchronise():
    """Validating CUDA inputs must not read device memory (no .item()/bool() on GPU tensors)."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    q, k, v = qkv()
    b = torch.ones(2, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        ssa_flash.ssa_attention(q, k, v, b=b, n=b * 1.5, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --------------------------------------------------------------------------------------------
# Issue 24: one rule for numbers and tensors, checked on CPU tensors that require grad too


@pytest.mark.parametrize("requires_grad", [False, True])
def test_b_tensor_nonpositive_is_refused_on_cpu(requires_grad):
    """b = -1 as a CPU tensor that requires grad (a learnable parameter) used to skip the check
    and give NaN outputs silently."""
    q, k, v = (t.cpu() for t in qkv(H=2))
    for bad in (torch.tensor(-1.0), torch.tensor([1.0, 0.0]), torch.tensor([1.0, float("nan")])):
        b = bad.clone().requires_grad_(requires_grad)
        with pytest.raises(ValueError, match="b must be finite and > 0"):
            ssa_flash.ssa_attention(q, k, v, b=b)
    n = torch.tensor([1.5, -0.5], requires_grad=requires_grad)
    with pytest.raises(ValueError, match="n must be finite and >= 0"):
        ssa_flash.ssa_attention(q, k, v, n=n)


def test_n_zero_one_rule():
    """n = 0 (uniform weights over the admissible keys) is accepted as a number and as a tensor
    alike, with or without grad; n < 0 is refused as both."""
    q, k, v = (t.cpu() for t in qkv(H=2))
    uniform = v.mean(dim=2, keepdim=True).expand_as(v)
    for n in (0.0, torch.tensor(0.0), torch.zeros(2), torch.zeros(2, requires_grad=True)):
        out = ssa_flash.ssa_attention(q, k, v, n=n, backend="reference")
        torch.testing.assert_close(out, uniform)
    for n in (-0.5, torch.tensor(-0.5), torch.full((2,), -0.5, requires_grad=True)):
        with pytest.raises(ValueError, match="n must be"):
            ssa_flash.ssa_attention(q, k, v, n=n, backend="reference")


def test_b_n_checks_do_not_break_gradients():
    """The value check reads a detached copy: a valid learnable b, n still get gradients."""
    q, k, v = (t.cpu() for t in qkv(H=2))
    b = torch.tensor([0.5, 1.0], requires_grad=True)
    n = torch.tensor([1.5, 2.0], requires_grad=True)
    ssa_flash.ssa_attention(q, k, v, b=b, n=n, backend="reference").sum().backward()
    assert b.grad is not None and n.grad is not None and torch.isfinite(b.grad).all()


FLAGS = ["is_causal", "enable_gqa", "adaptive_temperature", "return_lse", "deterministic"]


@pytest.mark.parametrize("flag", FLAGS)
def test_flags_refuse_ints(flag):
    """adaptive_temperature=1 was accepted silently while the other flags demanded a bool."""
    q, k, v = qkv()
    with pytest.raises(TypeError, match=f"{flag} must be a bool, got int"):
        ssa_flash.ssa_attention(q, k, v, **{flag: 1})


@pytest.mark.parametrize("flag", FLAGS)
def test_flags_accept_numpy_bool(flag):
    np = pytest.importorskip("numpy")
    q, k, v = qkv()
    want = ssa_flash.ssa_attention(q, k, v, backend="reference", **{flag: True})
    got = ssa_flash.ssa_attention(q, k, v, backend="reference", **{flag: np.bool_(True)})
    if flag == "return_lse":  # a numpy True must act as True, i.e. return the pair
        assert isinstance(got, tuple) and len(got) == 2
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want)


def test_flag_messages_name_the_real_type():
    """is_causal=np.int64(1) used to say "must be a bool, got int64"; np.bool_ was reported as
    "bool", contradicting the message."""
    np = pytest.importorskip("numpy")
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"is_causal must be a bool, got numpy\.int64"):
        ssa_flash.ssa_attention(q, k, v, is_causal=np.int64(1))
    with pytest.raises(TypeError, match=r"is_causal must be a bool, got str"):
        ssa_flash.ssa_attention(q, k, v, is_causal="yes")
    with pytest.raises(TypeError, match=r"scale must be a real number, got numpy\.bool"):
        ssa_flash.ssa_attention(q, k, v, scale=np.bool_(True))


def test_numpy_bool_flags_of_the_other_functions():
    np = pytest.importorskip("numpy")
    q, k, v = (t.cpu() for t in qkv())
    ent = ssa_flash.attention_entropy(q, k, is_causal=np.bool_(True), backend="reference")
    torch.testing.assert_close(ent, ssa_flash.attention_entropy(q, k, is_causal=True, backend="reference"))
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    cu = torch.tensor([0, 8], dtype=torch.int32)
    got = ssa_flash.varlen_attention(*packed, cu, cu, 8, 8, is_causal=np.bool_(True), score="ssa",
                                     score_params=(1.0, 1.5), adaptive_temperature=np.bool_(True), backend="reference")
    want = ssa_flash.varlen_attention(*packed, cu, cu, 8, 8, is_causal=True, score="ssa", score_params=(1.0, 1.5),
                                      adaptive_temperature=True, backend="reference")
    torch.testing.assert_close(got, want)


def test_packed_and_cache_functions_default_to_softmax_and_refuse_the_legacy_score_arguments():
    """One score API: varlen_attention, attention_with_kvcache (and ring_attention) take
    score= / score_params= as attention does, softmax by default; ssa=, b=, n= are gone."""
    q, k, v = (t.cpu() for t in qkv())
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    cu = torch.tensor([0, 8], dtype=torch.int32)
    dense = ssa_flash.softmax_attention(q, k, v, is_causal=True, backend="reference")[0].transpose(0, 1)
    torch.testing.assert_close(ssa_flash.varlen_attention(*packed, cu, cu, 8, 8, is_causal=True, backend="reference"),
                               dense)
    ssa = ssa_flash.varlen_attention(*packed, cu, cu, 8, 8, is_causal=True, score="ssa",
                                     score_params={"b": 0.7, "n": 2.0}, backend="reference")
    torch.testing.assert_close(ssa, ssa_flash.ssa_attention(q, k, v, is_causal=True, b=0.7, n=2.0,
                                                            backend="reference")[0].transpose(0, 1))
    lengths = torch.tensor([8], dtype=torch.int32)
    cache = ssa_flash.attention_with_kvcache(q[:, :, -1:], k, v, lengths, backend="reference")
    torch.testing.assert_close(cache, ssa_flash.softmax_attention(q[:, :, -1:], k, v, backend="reference"))
    for legacy in (dict(ssa=True), dict(b=1.0), dict(n=1.5)):
        with pytest.raises(TypeError, match=next(iter(legacy))):
            ssa_flash.varlen_attention(*packed, cu, cu, 8, 8, backend="reference", **legacy)
        with pytest.raises(TypeError, match=next(iter(legacy))):
            ssa_flash.attention_with_kvcache(q, k, v, lengths, backend="reference", **legacy)


def test_dropout_mask_on_meta():
    """device="meta" raised NotImplementedError (Cannot copy out of meta tensor): it now gives a
    meta tensor of the shape, as torch functions do there."""
    for backend in ("auto", "reference", "triton"):
        keep = ssa_flash.dropout_mask((2, 3, 5, 7), 0.5, device="meta", backend=backend)
        assert keep.is_meta and keep.shape == (2, 3, 5, 7) and keep.dtype == torch.bool
    keep = ssa_flash.dropout_mask((1, 1, 4, 4), 0.1, rng=torch.zeros(2, dtype=torch.int64, device="meta"))
    assert keep.is_meta and keep.shape == (1, 1, 4, 4)


def test_dropout_mask_bad_device():
    with pytest.raises(ValueError, match="device"):
        ssa_flash.dropout_mask((1, 1, 4, 4), 0.1, device="gpu0")
    with pytest.raises(TypeError, match="device"):
        ssa_flash.dropout_mask((1, 1, 4, 4), 0.1, device=1.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_triton_is_not_available_for_cuda_without_cuda():
    """available_backends("cuda") listed triton on a machine without CUDA."""
    assert "triton" not in ssa_flash.available_backends("cuda")
    assert ssa_flash.available_backends("cuda") == ("reference",)
    why = ssa_flash.backends.get("triton").unavailable_reason(torch.device("cuda"))
    assert why and "torch.cuda.is_available() is False" in why


_LATE_INTERPRETER = textwrap.dedent("""
    import os, sys, torch
    if sys.argv[1] == "triton":
        import triton  # noqa: F401  (Triton's own jit functions are made now, without the interpreter)
    else:
        import ssa_flash.triton.launch  # noqa: F401  (and this package's kernels too)
    os.environ["TRITON_INTERPRET"] = "1"
    import ssa_flash
    print("available:", ",".join(ssa_flash.available_backends("cpu")))
    q = torch.randn(1, 2, 16, 16)
    try:
        ssa_flash.ssa_attention(q, q, q, backend="triton")
        print("ran")
    except ssa_flash.BackendUnavailableError as err:
        print("refused:", err)
""")


@pytest.mark.parametrize("imported", ["triton", "kernels"])
def test_interpreter_switched_on_after_import_is_detected(imported):
    """TRITON_INTERPRET=1 set after Triton was imported: @triton.jit already made GPU kernels, so
    available_backends("cpu") listed triton and the call failed deep inside Triton. Now triton is
    not listed and the call says why."""
    pytest.importorskip("triton")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _LATE_INTERPRETER, imported], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "available: reference", proc.stdout
    assert lines[1].startswith("refused:") and "TRITON_INTERPRET=1 was set after" in lines[1], proc.stdout


def test_degenerate_inputs_go_through_the_reference_backend(monkeypatch):
    """No query row, no key or no value dim: the call goes ops -> autograd -> the reference
    backend like any other (the public layer does not call ssa_flash.reference itself), with the
    results of the specification: output 0, lse -inf (or the sink's), zero gradients."""
    from ssa_flash import autograd, reference

    seen = []
    attention, row_entropy = autograd.attention, autograd.row_entropy
    monkeypatch.setattr(autograd, "attention", lambda *a, **kw: seen.append(a[5]) or attention(*a, **kw))
    monkeypatch.setattr(autograd, "row_entropy", lambda *a, **kw: seen.append(a[4]) or row_entropy(*a, **kw))
    for name in ("attention", "varlen_attention", "attention_with_kvcache", "attention_entropy"):
        monkeypatch.setattr(reference, name, None)  # a call would raise TypeError
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 0, 8, dtype=torch.float64, requires_grad=True)
    for sinks in (None, 0.5):
        out, lse = ssa_flash.attention(q, k, k, score="ssa", score_params=(1.0, 1.5), sinks=sinks, dropout_p=0.3,
                                       return_lse=True, backend="auto")
        assert out.shape == (1, 2, 3, 8) and (out == 0).all()
        assert (lse == (float("-inf") if sinks is None else 0.5)).all()
        (grad,) = torch.autograd.grad(out.sum(), q)
        assert (grad == 0).all()
    assert ssa_flash.attention_entropy(q, k).shape == (1, 2, 3)
    cu = torch.tensor([0, 0], dtype=torch.int32)
    packed = torch.zeros(0, 2, 8, dtype=torch.float64)
    assert ssa_flash.varlen_attention(packed, packed, packed, cu, cu, 1, 1).shape == (0, 2, 8)
    cache = torch.zeros(1, 2, 0, 8, dtype=torch.float64)
    out = ssa_flash.attention_with_kvcache(q.detach(), cache, cache, torch.zeros(1, dtype=torch.int32))
    assert (out == 0).all()
    assert seen == ["reference"] * 5
