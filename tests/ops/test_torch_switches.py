"""torch's global switches, as SDPA users expect them honoured (ssa_flash/ops.py).

``torch.autocast``: SDPA's rule (``ops._autocast``): query, key and value in the autocast dtype
(float64 excepted), masks, score parameters and sinks as given, the computation itself run with
autocast off; gradients reach the inputs in their own dtypes. Checked on the device the suite runs
on (the CPU's autocast without a GPU), against the same call made outside autocast with the inputs
cast by hand, and against SDPA.

``torch.use_deterministic_algorithms(True)``: the calls run as with ``deterministic=True``, and the
Triton launcher times no block configuration (the KV-cache and ring paths take no argument)."""
import pytest
import torch
import torch.nn.functional as F

import ssa_flash
from ssa_flash import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", "triton"]


def _inputs(seed, dtype=torch.float32, B=1, H=2, L=24, D=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=dtype).to(DEVICE).requires_grad_() for _ in range(3)]


def _grads(out, *tensors):
    torch.manual_seed(0)
    dout = torch.randn(out.shape, dtype=torch.float32).to(out.device, out.dtype)
    return torch.autograd.grad(out, tensors, dout)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_casts_the_inputs_as_sdpa_does(backend, low):
    q, k, v = _inputs(0)
    b = torch.tensor([0.6, 1.3], device=DEVICE, requires_grad=True)
    n = torch.tensor([1.5, 2.0], device=DEVICE, requires_grad=True)
    mask = torch.randn(24, 24, device=DEVICE)  # float32 additive mask: added as given
    with torch.autocast(DEVICE, dtype=low):
        # deterministic: bitwise comparable on a GPU too (no atomics, no timed tile choice)
        out = ssa_flash.ssa_attention(q, k, v, mask, is_causal=True, b=b, n=n, backend=backend, deterministic=True)
        sdpa = F.scaled_dot_product_attention(q, k, v, mask, is_causal=True)
    assert out.dtype == sdpa.dtype == low
    grads = _grads(out, q, k, v, b, n)
    assert [g.dtype for g in grads] == [torch.float32] * 5

    # the same call outside autocast on inputs cast by hand: the same numbers
    qc, kc, vc = (x.detach().to(low).requires_grad_() for x in (q, k, v))
    bc, nc = (x.detach().clone().requires_grad_() for x in (b, n))
    ref = ssa_flash.ssa_attention(qc, kc, vc, mask, is_causal=True, b=bc, n=nc, backend=backend, deterministic=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for got, want in zip(grads, _grads(ref, qc, kc, vc, bc, nc)):
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_softmax_under_autocast_matches_sdpa(backend):
    q, k, v = _inputs(1)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = ssa_flash.softmax_attention(q, k, v, is_causal=True, backend=backend)
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out.float(), sdpa.float(), rtol=2e-2, atol=2e-2)


def test_mixed_dtypes_run_under_autocast_only():
    """A float32 query (RoPE or QK-norm in float32, say) beside bfloat16 keys: SDPA runs it under
    autocast; so do we. Outside autocast the dtype check still refuses it."""
    q = _inputs(2)[0]
    k, v = (x.detach().to(torch.bfloat16) for x in _inputs(3)[:2])
    with pytest.raises(TypeError, match="share a dtype"):
        ssa_flash.ssa_attention(q, k, v, backend="reference")
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = ssa_flash.ssa_attention(q, k, v, backend="reference")
    assert out.dtype == torch.bfloat16
    assert _grads(out, q)[0].dtype == torch.float32


def test_float64_is_not_cast():
    """autocast leaves float64 alone (its own rule): so do we."""
    q, k, v = _inputs(4, dtype=torch.float64)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = ssa_flash.ssa_attention(q, k, v, backend="reference")
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ssa_flash.ssa_attention(q, k, v, backend="reference"), rtol=0, atol=0)


def test_the_reference_is_not_autocast_inside():
    """The computation runs with autocast off: under autocast the reference's own float32 matmuls
    would otherwise be cast behind its back (the answer then differs from the cast-by-hand call's,
    which test_autocast_casts_the_inputs_as_sdpa_does compares bitwise)."""
    q, k, v = (x.detach() for x in _inputs(5))
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.matmul, torch.Tensor.matmul, torch.einsum):
                seen.append(torch.is_autocast_enabled(DEVICE))
            return func(*args, **(kwargs or {}))

    with torch.autocast(DEVICE, dtype=torch.bfloat16), Spy():
        ssa_flash.ssa_attention(q, k, v, backend="reference")
    assert seen and not any(seen)


def test_varlen_and_entropy_under_autocast():
    q, k, v = (x.detach()[0].transpose(0, 1).contiguous() for x in _inputs(6))  # (24, 2, 16)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = ssa_flash.varlen_attention(q, k, v, cu, cu, 14, 14, is_causal=True, backend="reference", score="ssa",
                                         score_params=(1.0, 1.5))
        ent = ssa_flash.attention_entropy(q.transpose(0, 1), k.transpose(0, 1), backend="reference")
    assert out.dtype == torch.bfloat16
    qc, kc, vc = (x.to(torch.bfloat16) for x in (q, k, v))
    torch.testing.assert_close(out, ssa_flash.varlen_attention(qc, kc, vc, cu, cu, 14, 14, is_causal=True,
                                                               backend="reference", score="ssa",
                                                               score_params=(1.0, 1.5)), rtol=0, atol=0)
    torch.testing.assert_close(ent, ssa_flash.attention_entropy(qc.transpose(0, 1), kc.transpose(0, 1),
                                                                backend="reference"), rtol=0, atol=0)


def test_a_planned_call_and_autocast_agree():
    """A call planned outside autocast, then the same tensors under autocast: the plan of the
    float32 call is not replayed for the cast inputs (their metadata differ), and back."""
    ops._call_plans.clear()
    q, k, v = (x.detach() for x in _inputs(7))
    plain = [ssa_flash.softmax_attention(q, k, v, backend="triton") for _ in range(2)]
    with torch.autocast(DEVICE, dtype=torch.float16):
        cast = [ssa_flash.softmax_attention(q, k, v, backend="triton") for _ in range(2)]
    assert [o.dtype for o in plain + cast] == [torch.float32] * 2 + [torch.float16] * 2
    torch.testing.assert_close(cast[1], ssa_flash.softmax_attention(q.half(), k.half(), v.half(), backend="triton"),
                               rtol=0, atol=0)
    torch.testing.assert_close(plain[1], plain[0], rtol=0, atol=0)


@pytest.fixture
def deterministic_algorithms():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _specs_seen(monkeypatch):
    from ssa_flash import autograd

    seen, real = [], autograd.attention

    def spy(q, k, v, params, mask, backend, spec, **kw):
        seen.append(spec.deterministic)
        return real(q, k, v, params, mask, backend, spec, **kw)

    monkeypatch.setattr(autograd, "attention", spy)
    return seen


def test_deterministic_algorithms_reach_the_backend(monkeypatch, request):
    ops._call_plans.clear()
    seen = _specs_seen(monkeypatch)
    q, k, v = (x.detach() for x in _inputs(8))
    ssa_flash.ssa_attention(q, k, v, backend="triton")
    ssa_flash.ssa_attention(q, k, v, backend="triton")  # planned: replayed as it was
    request.getfixturevalue("deterministic_algorithms")
    ssa_flash.ssa_attention(q, k, v, backend="triton")  # not the plan of the calls above
    cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=DEVICE)
    packed = [x[0].transpose(0, 1).contiguous() for x in (q, k, v)]
    ssa_flash.varlen_attention(*packed, cu, cu, 14, 14, backend="triton", score="ssa", score_params=(1.0, 1.5))
    assert seen == [False, False, True, True]


def test_deterministic_algorithms_stop_the_tuning(deterministic_algorithms):
    from ssa_flash.triton import block_choice, launch

    assert not block_choice.autotuning()
