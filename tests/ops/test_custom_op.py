"""The custom ops (torch.ops.ssa_flash) over every backend: registration (opcheck), torch.compile
with fullgraph=True against eager, the stride-0 mask, the lse gradient, and CUDA graph capture.

On the CPU the Triton backend runs in Triton's interpreter and the CUDA backend in the CPU
emulation of its kernels (csrc/emu, see emulation.py); CUDA-graph tests need a CUDA device."""
import pytest
import torch

import ssa_flash
from ssa_flash import autograd as ssa_autograd
from ssa_flash.backends import cuda_backend
from ssa_flash.spec import AttentionSpec
from ssa_flash.nn import SSAttention
from ssa_flash.temperature import DEFAULT_POLY, DEFAULT_THRESHOLD
from ssa_flash.triton import launch

from attn_testing import CUDA, DEVICE, head_params, make_qkv, needs_cuda, needs_kernels
from emulation import build_emulator

pytestmark = needs_kernels

POLY = list(DEFAULT_POLY)
DEVICES = ["cpu", "cuda"] if CUDA else ["cpu"]
OP_BACKENDS = ["triton", "cuda", "reference"]


def _inputs(device, dtype=torch.float32, Hq=2, Hkv=2, L=16, D=8, seed=0):
    q, k, v = make_qkv(B=1, Hq=Hq, Hkv=Hkv, Lq=L, D=D, dtype=dtype, device=device, seed=seed)
    b, n = head_params(Hq, dtype=dtype, device=device)
    return q, k, v, b, n


def _clear_grads(*tensors):
    for t in tensors:
        t.grad = None


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_emulator(tmp_path_factory.mktemp("emu"))


@pytest.fixture
def on_backend(request):
    """(backend name, dtype, context to run it in): on the CPU the CUDA backend runs in the
    emulation of its kernels."""
    name = request.param
    if name == "cuda":
        if not CUDA:
            return name, torch.float16, cuda_backend.emulated(request.getfixturevalue("emulator"))
        if "cuda" not in ssa_flash.available_backends("cuda"):
            pytest.skip(f"CUDA backend unavailable: {cuda_backend.unavailable_reason(torch.device('cuda'))}")
        return name, torch.float16, cuda_backend.emulated(None)
    dtype = torch.float32 if (name == "triton" and CUDA) else torch.float64
    return name, dtype, cuda_backend.emulated(None)


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


def test_schema_carries_the_spec():
    """Every op ends with the backend name and the AttentionSpec fields, in field order."""
    spec_args = ["scale", "score", "causal", "group", "adaptive", "poly", "threshold", "deterministic",
                 "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_k", "k_start",
                 "num_splits", "dropout_p", "window_left", "window_right", "dropout_rng", "softcap"]
    for op in (torch.ops.ssa_flash.attn_fwd, torch.ops.ssa_flash.attn_bwd, torch.ops.ssa_flash.row_entropy):
        names = [a.name for a in op.default._schema.arguments]
        assert names[-len(spec_args) - 1:] == ["backend"] + spec_args, names
        types = {a.name: str(a.type) for a in op.default._schema.arguments}
        assert types["cu_seqlens_q"] == types["seqused_k"] == "Optional[Tensor]", types
        assert types["score_params"] == "List[Tensor]" and types["score"] == "str", types
    spec = AttentionSpec(scale=0.25, causal=True, group=2, adaptive=True, poly=(1, 2.5), threshold=0.1)
    assert spec.op_args() == (0.25, "softmax", True, 2, True, [1.0, 2.5], 0.1, False, None, None, 0, 0, None, None, 0, 0.0, -1, -1,
                              None, 0.0)
    assert AttentionSpec.from_op_args(spec.op_args()) == spec
    cu = torch.tensor([0, 3], dtype=torch.int32)
    packed = AttentionSpec(scale=0.25, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3)
    back = AttentionSpec.from_op_args(packed.op_args())
    assert back.cu_seqlens_q is cu and back == packed and hash(back) == hash(packed)
    rng = torch.tensor([5, 7])
    spec = AttentionSpec(scale=0.25, dropout_p=0.5, window_left=3, dropout_rng=rng)
    assert AttentionSpec.from_op_args(spec.op_args()).dropout_rng is rng


def _fwd_args(variant, dtype, backend):
    q, k, v, b, n = _inputs(DEVICE, dtype, Hq=4, Hkv=2, D=24)
    if variant == "softmax":
        return (q, k, v, [], None, None, backend, *AttentionSpec(scale=0.3, group=2).op_args())
    if variant == "ssa_dropout_window":  # a tensor-valued spec field (the dropout seed)
        spec = AttentionSpec(scale=0.3, score="ssa", group=2, dropout_p=0.25, window_left=5, window_right=2,
                             dropout_rng=torch.tensor([123, 45], device=q.device))
        return (q, k, v, [b.to(spec_dtype(dtype)), n.to(spec_dtype(dtype))], None, None, backend, *spec.op_args())
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(1, 1, 16, 16, generator=g) > 0.2).to(q.device).expand(1, 4, 16, 16)
    if variant == "logit_scale_adaptive_mask":  # a score function with one parameter
        spec = AttentionSpec(scale=0.3, score="logit_scale", causal=True, group=2, adaptive=True)
        return (q, k, v, [b.to(spec_dtype(dtype))], None, mask, backend, *spec.op_args())
    spec = AttentionSpec(scale=0.3, score="ssa", causal=True, group=2, adaptive=True)
    return (q, k, v, [b.to(spec_dtype(dtype)), n.to(spec_dtype(dtype))], None, mask, backend, *spec.op_args())


def spec_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytest.mark.parametrize("on_backend", OP_BACKENDS, indirect=True)
@pytest.mark.parametrize("variant", ["ssa_adaptive_mask", "softmax", "ssa_dropout_window", "logit_scale_adaptive_mask"])
def test_opcheck_forward(variant, on_backend):
    """Schema, fake (meta) implementation, autograd registration, AOT dispatch (static and dynamic)."""
    backend, dtype, context = on_backend
    with context:
        torch.library.opcheck(torch.ops.ssa_flash.attn_fwd.default, _fwd_args(variant, dtype, backend))


@pytest.mark.parametrize("on_backend", OP_BACKENDS, indirect=True)
def test_opcheck_backward(on_backend):
    backend, dtype, context = on_backend
    q, k, v, params, _, mask, _, *spec_args = _fwd_args("ssa_adaptive_mask", dtype, backend)
    q, k, v = (t.detach() for t in (q, k, v))
    params = [t.detach() for t in params]
    with context:
        out, lse, beta, lse_l, ent, dbeta_dh = torch.ops.ssa_flash.attn_fwd(q, k, v, params, None, mask, backend,
                                                                            *spec_args)
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        torch.library.opcheck(torch.ops.ssa_flash.attn_bwd.default,
                              (dout, dlse, q, k, v, out, lse, params, None, mask, beta, lse_l, ent, dbeta_dh,
                               False, backend, *spec_args))


@pytest.mark.parametrize("on_backend", OP_BACKENDS, indirect=True)
def test_opcheck_row_entropy(on_backend):
    backend, dtype, context = on_backend
    q, k, v, params, _, mask, _, *spec_args = _fwd_args("ssa_adaptive_mask", dtype, backend)
    with context:
        torch.library.opcheck(torch.ops.ssa_flash.row_entropy.default,
                              (q.detach(), k.detach(), [t.detach() for t in params], None, mask, backend, *spec_args))


def test_fake_shapes_without_data():
    """The fake implementation gives the real op's shapes and dtypes (GQA, Dv != D)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = AttentionSpec(scale=0.3, score="ssa", group=2, adaptive=True).op_args()
    with FakeTensorMode():
        q = torch.empty(2, 4, 5, 8, dtype=torch.float16)
        k = torch.empty(2, 2, 7, 8, dtype=torch.float16)
        v = torch.empty(2, 2, 7, 3, dtype=torch.float16)
        bn = torch.empty(4)
        out, lse, beta, *_ = torch.ops.ssa_flash.attn_fwd(q, k, v, [bn, bn], None, None, "cuda", *spec)
        assert out.shape == (2, 4, 5, 3) and out.dtype == torch.float16
        assert lse.shape == beta.shape == (2, 4, 5) and lse.dtype == torch.float32
        dq, dk, dv, dparams, dsinks, dmask = torch.ops.ssa_flash.attn_bwd(
            out, None, q, k, v, out, lse, [bn, bn], None, None, beta, beta, beta, beta, False, "triton", *spec)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        assert [d.shape for d in dparams] == [(4,), (4,)]
        assert dsinks.shape == (0,) and dmask.shape == (0,)
        mask = torch.empty(1, 4, 5, 7)  # a learned (1, H, Lq, Lk) bias: its gradient of its own shape
        *_, dparams, dsinks, dmask = torch.ops.ssa_flash.attn_bwd(out, None, q, k, v, out, lse, [], bn, mask,
                                                                  beta, beta, beta, beta, True, "reference", *spec)
        assert dparams == [] and dsinks.shape == (4,) and dsinks.dtype == torch.float32
        assert dmask.shape == mask.shape
        ent, lse_l = torch.ops.ssa_flash.row_entropy(q, k, [], None, None, "reference", *spec)
        assert ent.shape == lse_l.shape == (2, 4, 5) and ent.dtype == torch.float32


# --------------------------------------------------------------------------------------------
# Eager behaviour of the op-based autograd


def test_mask_reaches_kernel_as_stride0_view(count_launches):
    q, k, v, b, n = _inputs(DEVICE)
    mask = (torch.rand(16, 16, generator=torch.Generator().manual_seed(2)) > 0.3).to(DEVICE)
    out = ssa_flash.ssa_attention(q, k, v, mask, b=b, n=n, backend="triton")
    out.sum().backward()
    assert count_launches["forward"] == 1 and count_launches["backward"] == 1
    assert count_launches["masks"][0][:2] == (0, 0), "the mask was materialised before the kernel"
    ref = ssa_flash.reference.attention(q, k, v, mask, score="ssa", score_params=(b, n))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("on_backend", OP_BACKENDS, indirect=True)
def test_lse_only_gradient(on_backend):
    """A loss on lse alone: the output gradient is None in the backward. (For "reference" this
    goes through the ops directly: the public reference path is plain autograd.)"""
    backend, dtype, context = on_backend
    q, k, v, b, n = _inputs(DEVICE, dtype)
    b, n = (t.detach().float().requires_grad_() if dtype != torch.float64 else t for t in (b, n))
    spec = AttentionSpec(scale=8 ** -0.5, score="ssa", causal=True)
    with context:
        _, lse = ssa_autograd.attention(q, k, v, (b, n), None, backend, spec)
        ours = torch.autograd.grad(lse.sum(), (q, k, b, n))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, b, n)]
    _, lse_ref = ssa_flash.reference.attention(*leaves[:3], is_causal=True, score="ssa",
                                               score_params=(leaves[3], leaves[4]), return_lse=True)
    ref = torch.autograd.grad(lse_ref.sum(), leaves[:2] + leaves[3:])
    tol = 1e-9 if dtype == torch.float64 else 2e-2
    for a, e in zip(ours, ref):
        torch.testing.assert_close(a.double(), e, atol=tol, rtol=tol)


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
    if device == DEVICE:  # the kernels' device (CPU tensors run the reference on a GPU machine)
        assert count_launches["forward"] >= 2 and count_launches["backward"] >= 2


def test_compile_fullgraph_adaptive_gqa(count_launches):
    q, k, v, b, n = _inputs(DEVICE, Hq=4, Hkv=2)

    def fn(q, k, v, b, n):
        out = ssa_flash.ssa_attention(q, k, v, enable_gqa=True, b=b, n=n, adaptive_temperature=True)
        return (out * out).sum()

    _compare_compiled(fn, (q, k, v, b, n), (q, k, v, b, n), backend="aot_eager")
    assert count_launches["backward"] >= 2


def test_compile_fullgraph_dropout_window(count_launches):
    """Dropout's (seed, offset) is drawn inside the graph (a random op, not a baked constant):
    under the same torch.manual_seed compiled == eager, and two seeds differ."""
    q, k, v, b, n = _inputs(DEVICE, L=20)

    def fn(q, k, v, b, n):
        out = ssa_flash.ssa_attention(q, k, v, dropout_p=0.3, window_size=(4, 3), b=b, n=n)
        return (out * out).sum()

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    results = []
    for f, seed in ((compiled, 0), (fn, 0), (compiled, 1)):
        torch.manual_seed(seed)
        loss = f(q, k, v, b, n)
        results.append((loss,) + torch.autograd.grad(loss, (q, k, v, b, n)))
    for x, y in zip(results[0], results[1]):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    assert not torch.equal(results[0][0], results[2][0])
    assert count_launches["backward"] >= 3


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

    block = Block().to(DEVICE)
    q, k, v, _, _ = _inputs(DEVICE)
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


@pytest.fixture
def count_backend_calls(monkeypatch):
    """Counts the calls of each backend's forward/backward/row_entropy (through the ops)."""
    from ssa_flash import backends

    calls = {}
    for name in backends.NAMES:
        mod = backends.get(name)
        for fn in ("forward", "backward", "row_entropy"):
            def counted(*args, _orig=getattr(mod, fn), _key=(name, fn), **kw):
                calls[_key] = calls.get(_key, 0) + 1
                return _orig(*args, **kw)

            monkeypatch.setattr(mod, fn, counted)
    return calls


@pytest.mark.parametrize("on_backend", OP_BACKENDS, indirect=True)
def test_compile_fullgraph_every_backend(on_backend, count_backend_calls):
    """The public functions with an explicit backend compile without graph breaks and match
    eager: SSA with adaptive temperature, GQA, a broadcast bool mask, causal, a loss through out
    and lse, gradients of q, k, v, b, n; softmax; the entropy diagnostic in the same graph."""
    backend, dtype, context = on_backend
    q, k, v, b, n = _inputs(DEVICE, dtype, Hq=4, Hkv=2, D=24)
    b, n = (t.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
            for t in (b, n))
    mask = (torch.rand(16, 16, generator=torch.Generator().manual_seed(4)) > 0.2).to(DEVICE)
    mask[:, 0] = True  # no empty rows: lse stays finite

    def fn(q, k, v, b, n, mask):
        out, lse = ssa_flash.ssa_attention(q, k, v, mask, is_causal=True, enable_gqa=True, b=b, n=n,
                                           adaptive_temperature=True, return_lse=True, backend=backend)
        soft = ssa_flash.softmax_attention(q, k, v, enable_gqa=True, backend=backend)
        ent = ssa_flash.attention_entropy(q, k, mask, enable_gqa=True, backend=backend)
        return (out.double() ** 2).sum() + lse.double().sum() + (soft.double() * out.double()).sum() + ent.double().sum()

    leaves = (q, k, v, b, n)
    with context:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager" if backend == "reference" else "inductor")
        loss_c = compiled(q, k, v, b, n, mask)
        grads_c = torch.autograd.grad(loss_c, leaves)
        loss_e = fn(q, k, v, b, n, mask)
        grads_e = torch.autograd.grad(loss_e, leaves)
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(loss_c, loss_e, atol=tol, rtol=tol)
    for name, gc, ge in zip("qkvbn", grads_c, grads_e):
        assert gc.abs().sum() > 0, name
        torch.testing.assert_close(gc, ge, atol=tol, rtol=tol, msg=lambda m: f"d{name}: {m}")
    if backend != "reference":  # the public reference path is plain autograd, not the ops
        # eager and compiled each: 2 forwards (ssa, softmax), 1 backward, 2 entropy passes
        assert count_backend_calls.get((backend, "forward"), 0) >= 4
        assert count_backend_calls.get((backend, "backward"), 0) >= 2
        assert count_backend_calls.get((backend, "row_entropy"), 0) >= 4
    others = {key for key in count_backend_calls if key[0] != backend}
    assert not others, f"other backends ran: {others}"


# --------------------------------------------------------------------------------------------
# CUDA graphs


def _variant_call(variant, q, k, v, b, n, **kw):
    """One of the four variants; ``b``, ``n`` are used by the SSA ones only."""
    adaptive = variant.endswith("adaptive")
    if variant.startswith("ssa"):
        return ssa_flash.ssa_attention(q, k, v, b=b, n=n, adaptive_temperature=adaptive, **kw)
    if adaptive:
        return ssa_flash.adaptive_temperature_attention(q, k, v, **kw)
    return ssa_flash.softmax_attention(q, k, v, **kw)


@needs_cuda
@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("variant", ["softmax", "ssa", "adaptive", "ssa_adaptive"])
def test_cuda_graph_capture_forward_backward(variant, backend):
    """Forward and backward captured in one CUDA graph, replayed on new data == eager, bitwise."""
    if backend not in ssa_flash.available_backends("cuda"):
        pytest.skip(f"{backend} backend unavailable: {cuda_backend.unavailable_reason(torch.device('cuda'))}")
    adaptive = variant.endswith("adaptive")
    dtype = {"triton": torch.float32 if adaptive else torch.float16, "cuda": torch.float16,
             "reference": torch.float32}[backend]
    q, k, v, b, n = _inputs("cuda", dtype, L=64, D=32)
    b, n = b.float().detach().requires_grad_(), n.float().detach().requires_grad_()
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    leaves = (q, k, v, b, n) if variant.startswith("ssa") else (q, k, v)

    # bitwise: the CUDA backward's default accumulates dQ with atomics, deterministic=True does not
    det = backend == "cuda"

    def step():
        out = _variant_call(variant, q, k, v, b, n, is_causal=True, backend=backend, deterministic=det)
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
    eb, en = (eager_leaves[3], eager_leaves[4]) if len(eager_leaves) == 5 else (b, n)
    out = _variant_call(variant, *eager_leaves[:3], eb, en, is_causal=True, backend=backend, deterministic=det)
    out.backward(dout)
    expected = [out] + [t.grad for t in eager_leaves]
    for name, c, e in zip(["out", "dq", "dk", "dv", "db", "dn"], captured, expected):
        torch.testing.assert_close(c, e, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_cuda_graph_dropout_draws_anew_on_replay(backend):
    """Dropout inside a captured graph: the (seed, offset) draw is a captured generator op, so each
    replay uses fresh bits (outputs differ between replays); outputs and gradients stay finite."""
    if backend not in ssa_flash.available_backends("cuda"):
        pytest.skip(f"{backend} backend unavailable: {cuda_backend.unavailable_reason(torch.device('cuda'))}")
    q, k, v, b, n = _inputs("cuda", torch.float16, L=64, D=32)
    b, n = b.float().detach().requires_grad_(), n.float().detach().requires_grad_()

    def step():
        out = ssa_flash.ssa_attention(q, k, v, dropout_p=0.5, b=b, n=n, backend=backend)
        out.float().sum().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _clear_grads(q, k, v, b, n)
            step()
    torch.cuda.current_stream().wait_stream(side)
    _clear_grads(q, k, v, b, n)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    outs = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        outs.append(static_out.clone())
        assert torch.isfinite(static_out).all() and torch.isfinite(q.grad).all()
    assert not torch.equal(outs[0], outs[1])
