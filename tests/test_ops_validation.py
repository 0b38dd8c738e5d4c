"""Bad input gets a clear ValueError / TypeError naming the argument (DESIGN.md 2), before any
kernel runs; backends that cannot run say why."""
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
    with pytest.raises(ValueError, match="query"):
        fn(q[0, 0], k, v, backend=backend)
    with pytest.raises(ValueError, match="head dim"):
        fn(q, k[..., :8], v, backend=backend)
    with pytest.raises(ValueError, match="batch"):
        fn(q, torch.cat([k, k]), torch.cat([v, v]), backend=backend)
    with pytest.raises(ValueError, match="key .* and value"):
        fn(q, k, v[:, :, :5], backend=backend)
    with pytest.raises(ValueError, match="enable_gqa"):
        fn(q, k[:, :1], v[:, :1], backend=backend)
    q3 = torch.randn(1, 3, 8, 16, device=DEVICE)
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


def test_mask_requiring_grad_is_refused():
    q, k, v = qkv()
    mask = torch.zeros(8, 8, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask"):
        ssa_flash.ssa_attention(q, k, v, attn_mask=mask)


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
    torch.testing.assert_close(out, ssa_flash.reference.ssa_attention(q, k, v), atol=1e-5, rtol=1e-5)


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
