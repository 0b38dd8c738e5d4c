"""Matmul precision of the Triton kernels: float32 follows torch's TF32 setting on GPUs
(the ``DOT_PRECISION`` constexpr of the captured launches), and bfloat16 on the CPU interpreter
gives FlashAttention-accurate results (computed in float32, rounded to bfloat16) instead of the
interpreter's wrong bfloat16 ``tl.dot``."""
import pytest
import torch

import ssa_flash
from attn_testing import INTERPRETER, MODES, check, make_qkv, needs_kernels

triton = pytest.importorskip("triton")

from ssa_flash.triton import kernel_args, launch  # noqa: E402


@pytest.fixture
def restore_matmul_precision():
    before = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cuda.matmul.allow_tf32 = before[1]


def _captured_precisions(arch, dtype):
    """The DOT_PRECISION of every kernel a forward + backward (adaptive SSA) would launch."""
    q = torch.empty(1, 2, 64, 64, device="meta", dtype=dtype)
    acc = torch.float32
    b = n = torch.empty(2, device="meta", dtype=acc)
    spec = launch.AttentionSpec(scale=0.125, causal=True, group=1, adaptive=True, score="ssa")
    stat = torch.empty(1, 2, 64, device="meta", dtype=acc)
    with launch.capture_launches(arch) as cap:
        launch.row_entropy(q, q, None, (b, n), spec)
        launch.forward(q, q, q, None, (b, n), stat, spec)
        launch.backward(q, q, q, q, q, stat, None, None, (b, n), launch.TemperatureState(stat, stat, stat, stat), spec)
    assert [kl.name for kl in cap] == ["row_entropy", "fwd", "bwd_dq", "bwd_dkdv"]
    return {kl.constexprs["DOT_PRECISION"] for kl in cap}


@pytest.mark.parametrize("arch", [80, 90, 100, 120])
def test_float32_follows_torch_matmul_precision(restore_matmul_precision, arch):
    """"highest" (torch's default): IEEE float32 dots; "high" / "medium" or allow_tf32: TF32 tensor
    cores, like torch's own float32 matmuls. The precision is a constexpr: another kernel."""
    torch.set_float32_matmul_precision("highest")
    assert _captured_precisions(arch, torch.float32) == {"ieee"}
    for setting in ("high", "medium"):
        torch.set_float32_matmul_precision(setting)
        assert _captured_precisions(arch, torch.float32) == {"tf32"}
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = True
    assert _captured_precisions(arch, torch.float32) == {"tf32"}
    torch.backends.cuda.matmul.allow_tf32 = False
    assert _captured_precisions(arch, torch.float32) == {"ieee"}


def test_precision_leaves_other_dtypes_and_targets_alone(restore_matmul_precision):
    """16-bit inputs (which TF32 does not concern) keep their kernels; sm_75 has no TF32; float64
    and the interpreter run IEEE."""
    torch.set_float32_matmul_precision("high")
    for dtype in (torch.bfloat16, torch.float16):
        assert _captured_precisions(90, dtype) == {"ieee"}
    assert _captured_precisions(75, torch.float32) == {"ieee"}
    assert kernel_args.dot_precision(torch.float64, 90) == "ieee"
    assert kernel_args.dot_precision(torch.float32, None) == "ieee"


needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="the CPU interpreter's bfloat16 path")


@needs_kernels
@needs_interpreter
@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_on_the_cpu(mode):
    """Forward and backward in bfloat16 through the interpreter against the float64 reference,
    FlashAttention's rule (2x the error of the naive bfloat16 computation); outputs and input
    gradients come back in bfloat16 (the interpreter's own bfloat16 dot gave outputs ~1e9)."""
    q, k, v = make_qkv(B=1, Hq=2, Lq=19, Lk=23, D=16, dtype=torch.bfloat16)
    out, lse, grads = check(mode, q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    assert all(grads[name].dtype == torch.bfloat16 for name in "qkv")


@needs_kernels
@needs_interpreter
def test_bfloat16_on_the_cpu_entropy_and_mask():
    """The statistics pass and an additive bfloat16 mask: the same as float32 inputs holding the
    same (bfloat16) values, which the interpreter computes exactly."""
    q, k, v = make_qkv(B=1, Hq=2, Lq=17, D=16, dtype=torch.bfloat16, requires_grad=False)
    mask = torch.randn(17, 17).to(torch.bfloat16)
    ent = ssa_flash.attention_entropy(q, k, attn_mask=mask, backend="triton")
    ent32 = ssa_flash.attention_entropy(q.float(), k.float(), attn_mask=mask.float(), backend="triton")
    torch.testing.assert_close(ent.float(), ent32.float(), rtol=0, atol=0)
    out = ssa_flash.softmax_attention(q, k, v, attn_mask=mask, backend="triton")
    out32 = ssa_flash.softmax_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(), backend="triton")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, out32.to(torch.bfloat16))


@needs_kernels
@needs_interpreter
def test_bfloat16_on_the_cpu_under_torch_compile():
    """The bfloat16 path sits inside the custom op: a full graph compiles, and its output and
    gradients are bfloat16 and accurate."""
    q, k, v = make_qkv(B=1, Hq=2, Lq=20, D=16, dtype=torch.bfloat16)
    fn = torch.compile(lambda q, k, v: ssa_flash.ssa_attention(q, k, v, is_causal=True, b=1.0, n=1.5,
                                                               backend="triton"), fullgraph=True)
    out = fn(q, k, v)
    out.float().sum().backward()
    gold = ssa_flash.ssa_attention(*(t.detach().double() for t in (q, k, v)), is_causal=True, b=1.0, n=1.5,
                                   backend="reference")
    assert out.dtype == q.grad.dtype == torch.bfloat16
    assert (out.double() - gold).abs().max().item() < 2e-2  # bfloat16's rounding of |out| <= ~2
