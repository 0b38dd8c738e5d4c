"""The Triton kernels as torch.library custom ops: registration (opcheck), torch.compile with
fullgraph=True against eager, the stride-0 mask, the lse gradient, and CUDA graph capture."""
import pytest
import torch

import ssa_flash
from ssa_flash import autograd as ssa_autograd  # noqa: F401  (registers ssa_flash::attn_fwd/bwd)
from ssa_flash.nn import SSAttention
from ssa_flash.temperature import DEFAULT_POLY, DEFAULT_THRESHOLD
from ssa_flash.triton import launch

from attn_testing import CUDA, DEVICE, head_params, make_qkv, needs_cuda, needs_kernels

pytestmark = needs_kernels

POLY = list(DEFAULT_POLY)
DEVICES = ["cpu", "cuda"] if CUDA else ["cpu"]


def _inputs(device, dtype=torch.float32, Hq=2, Hkv=2, L=16, D=8, seed=0):
    q, k, v = make_qkv(B=1, Hq=Hq, Hkv=Hkv, Lq=L, D=D, dtype=dtype, device=device, seed=seed)
    b, n = head_params(Hq, dtype=dtype, device=device)
    return q, k, v, b, n


def _clear_grads(*tensors):
    for t in tensors:
        t.grad = None


@pytest.fixture
def count_launches(monkeypatch):
    """Counts the Triton forward/backward launches (proves the kernels ran, not the reference)."""
    calls = {"forward": 0, "backward": 0, "masks": []}
    fwd, bwd = launch.forward, launch.backward

    def forward(q, k, v, mask, *args, **kw):
        calls["forward"] += 1
        calls["masks"].append(None if mask is None else mask.stride())
        return fwd(q, k, v, mask, *args, **kw)

    def backward(*args, **kw):
        calls["backward"] += 1
        return bwd(*args, **kw)

    monkeypatch.setattr(launch, "forward", forward)
    monkeypatch.setattr(launch, "backward", backward)
    return calls


# --------------------------------------------------------------------------------------------
# Registration


@pytest.mark.parametrize("variant", ["ssa_adaptive_mask", "softmax"])
def test_opcheck_forward(variant):
    """Schema, fake (meta) implementation, autograd registration, AOT dispatch (static and dynamic)."""
    q, k, v, b, n = _inputs("cpu", torch.float64)
    if variant == "softmax":
        args = (q, k, v, None, None, None, 0.3, False, 1, False, [1.0], 0.5)
    else:
        mask = (torch.rand(1, 1, 16, 16, generator=torch.Generator().manual_seed(1)) > 0.2).expand(1, 2, 16, 16)
        args = (q, k, v, b, n, mask, 0.3, True, 1, True, POLY, DEFAULT_THRESHOLD)
    torch.library.opcheck(torch.ops.ssa_flash.attn_fwd.default, args)


def test_opcheck_backward():
    q, k, v, b, n = (t.detach() for t in _inputs("cpu", torch.float64))
    out, lse, *_ = torch.ops.ssa_flash.attn_fwd(q, k, v, b, n, None, 0.3, True, 1, False, [1.0], 0.5)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.library.opcheck(torch.ops.ssa_flash.attn_bwd.default,
                          (dout, dlse, q, k, v, out, lse, b, n, None, None, None, None, None,
                           0.3, True, 1, False))


def test_fake_shapes_without_data():
    """The fake implementation gives the real op's shapes and dtypes (GQA, Dv != D)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 4, 5, 8, dtype=torch.float16)
        k = torch.empty(2, 2, 7, 8, dtype=torch.float16)
        v = torch.empty(2, 2, 7, 3, dtype=torch.float16)
        bn = torch.empty(4)
        out, lse, beta, *_ = torch.ops.ssa_flash.attn_fwd(q, k, v, bn, bn, None, 0.3, False, 2, True, POLY, 0.5)
        assert out.shape == (2, 4, 5, 3) and out.dtype == torch.float16
        assert lse.shape == beta.shape == (2, 4, 5) and lse.dtype == torch.float32
        dq, dk, dv, db, dn = torch.ops.ssa_flash.attn_bwd(out, None, q, k, v, out, lse, bn, bn, None,
                                                          None, None, None, None, 0.3, False, 2, False)
        assert (dq.shape, dk.shape, dv.shape, db.shape) == (q.shape, k.shape, v.shape, (4,))


# --------------------------------------------------------------------------------------------
# Eager behaviour of the op-based autograd


def test_mask_reaches_kernel_as_stride0_view(count_launches):
    q, k, v, b, n = _inputs("cpu")
    mask = torch.rand(16, 16, generator=torch.Generator().manual_seed(2)) > 0.3
    out = ssa_flash.ssa_attention(q, k, v, mask, b=b, n=n, backend="triton")
    out.sum().backward()
    assert count_launches["forward"] == 1 and count_launches["backward"] == 1
    assert count_launches["masks"][0][:2] == (0, 0), "the mask was materialised before the kernel"
    ref = ssa_flash.reference.ssa_attention(q, k, v, mask, b=b, n=n)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_lse_only_gradient():
    """A loss on lse alone: the output gradient is None in the backward."""
    q, k, v, b, n = _inputs("cpu", torch.float64)
    _, lse = ssa_flash.ssa_attention(q, k, v, is_causal=True, b=b, n=n, backend="triton", return_lse=True)
    ours = torch.autograd.grad(lse.sum(), (q, k, b, n))
    _, lse_ref = ssa_flash.reference.ssa_attention(q, k, v, is_causal=True, b=b, n=n, return_lse=True)
    ref = torch.autograd.grad(lse_ref.sum(), (q, k, b, n))
    for a, e in zip(ours, ref):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-9)


# --------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True)


def _compare_compiled(fn, args, grads_of, backend="inductor"):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)  # raises on any graph break
    loss_c = compiled(*args)
    grads_c = torch.autograd.grad(loss_c, grads_of)
    loss_e = fn(*args)
    grads_e = torch.autograd.grad(loss_e, grads_of)
    torch.testing.assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-5)
    for gc, ge in zip(grads_c, grads_e):
        assert gc.abs().sum() > 0
        torch.testing.assert_close(gc, ge, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_ssa_with_mask_and_lse(device, count_launches):
    """Default backend (inductor), b and n tensors requiring grad, a boolean mask broadcast from
    (Lq, Lk), causal, and a loss through both out and lse: compiled == eager, values and grads."""
    q, k, v, b, n = _inputs(device)
    mask = (torch.rand(16, 16, generator=torch.Generator().manual_seed(4)) > 0.2).to(device)
    mask[:, 0] = True  # no empty rows: lse stays finite

    def fn(q, k, v, b, n, mask):
        out, lse = ssa_flash.ssa_attention(q, k, v, mask, is_causal=True, b=b, n=n, return_lse=True)
        return (out * out).sum() + lse.sum()

    _compare_compiled(fn, (q, k, v, b, n, mask), (q, k, v, b, n))
    if device == "cpu":
        assert count_launches["forward"] >= 2 and count_launches["backward"] >= 2


def test_compile_fullgraph_adaptive_gqa(count_launches):
    q, k, v, b, n = _inputs("cpu", Hq=4, Hkv=2)

    def fn(q, k, v, b, n):
        out = ssa_flash.ssa_attention(q, k, v, enable_gqa=True, b=b, n=n, adaptive_temperature=True)
        return (out * out).sum()

    _compare_compiled(fn, (q, k, v, b, n), (q, k, v, b, n), backend="aot_eager")
    assert count_launches["backward"] >= 2


def test_compile_fullgraph_module_and_constant_params():
    """An nn.Module with SSAttention (parameters b_raw, n_raw) and, inside the same graph,
    softmax attention and SSA with plain-number / no-grad tensor b, n."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = SSAttention(2, b_init=[0.7, 1.4], n_init=[1.3, 2.2])
            self.fixed = SSAttention(2, learnable=False)

        def forward(self, q, k, v):
            x = self.attn(q, k, v, is_causal=True)
            y = self.fixed(q, k, v)
            z = ssa_flash.softmax_attention(q, k, v, is_causal=True)
            w = ssa_flash.ssa_attention(q, k, v, b=0.9, n=1.7)
            return (x * y).sum() + (z * w).sum()

    block = Block()
    q, k, v, _, _ = _inputs("cpu")
    params = (q, k, v, block.attn.b_raw, block.attn.n_raw)
    _compare_compiled(block, (q, k, v), params, backend="aot_eager")


def test_compile_inference_no_grad():
    """Under no_grad b and n do not require grad: the value check on CPU tensors must not
    break the graph."""
    q, k, v, b, n = (t.detach() for t in _inputs("cpu"))
    fn = lambda q, k, v, b, n: ssa_flash.ssa_attention(q, k, v, is_causal=True, b=b, n=n)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v, b, n), fn(q, k, v, b, n))


# --------------------------------------------------------------------------------------------
# CUDA graphs


@needs_cuda
@pytest.mark.parametrize("adaptive", [False, True])
def test_cuda_graph_capture_forward_backward(adaptive):
    q, k, v, b, n = _inputs("cuda", torch.float16 if not adaptive else torch.float32, L=64, D=32)
    b, n = b.float().detach().requires_grad_(), n.float().detach().requires_grad_()
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    leaves = (q, k, v, b, n)

    def step():
        out = ssa_flash.ssa_attention(q, k, v, is_causal=True, b=b, n=n, adaptive_temperature=adaptive,
                                      backend="triton")
        out.backward(dout)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, picks block sizes
        for _ in range(2):
            _clear_grads(*leaves)
            step()
    torch.cuda.current_stream().wait_stream(side)
    _clear_grads(*leaves)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    # new data in the captured input buffers, then replay
    with torch.no_grad():
        for t, seed in zip(leaves, range(10, 15)):
            t.copy_(t + 0.1 * torch.randn(t.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    captured = [static_out.clone()] + [t.grad.clone() for t in leaves]

    eager_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = ssa_flash.ssa_attention(*eager_leaves[:3], is_causal=True, b=eager_leaves[3], n=eager_leaves[4],
                                  adaptive_temperature=adaptive, backend="triton")
    out.backward(dout)
    expected = [out] + [t.grad for t in eager_leaves]
    for name, c, e in zip(["out", "dq", "dk", "dv", "db", "dn"], captured, expected):
        torch.testing.assert_close(c, e, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
