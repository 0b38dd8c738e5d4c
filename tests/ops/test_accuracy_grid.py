"""Accuracy in low precision on FlashAttention's grid of odd lengths and head dims, on a GPU.

Each kernel backend (Triton, CUDA C++), the four variants (softmax, adaptive, SSA, SSA +
adaptive), float16 and bfloat16, causal and not: the output, the LSE and the gradients of q, k, v
(and b, n for SSA) against the float64 reference under FlashAttention's rule (``attn_testing
.compare``: at most twice the naive same-dtype reference's error, plus a floor), on lengths and
head dims that are not tile multiples (FlashAttention's test sizes, paired rather than crossed:
the grid is for a GPU session's minutes). One row in four adds attention sinks, whose gradient is
held to the same rule. What a backend does not take (its ``supports()``) is skipped with its
reason. The CPU suite checks the same code paths at small sizes (the feature matrix,
tests/features.py); these sizes through the interpreter would take hours.
"""
import pytest
import torch

from attn_testing import MODES, check, make_qkv, needs_cuda
from ssa_flash.backends import AttentionSpec, get
from ssa_flash.scores import VARIANTS

pytestmark = needs_cuda

# (Lq, Lk, D): FlashAttention's odd lengths with its head dims (tests/test_flash_attn.py there)
GRID = [(113, 203, 40), (128, 217, 59), (113, 211, 64), (108, 256, 80), (256, 512, 96),
        (512, 256, 111), (799, 3, 128), (3, 799, 160), (1023, 1024, 192), (1024, 1023, 256)]
BACKENDS = ["triton", "cuda"]
DTYPES = [torch.float16, torch.bfloat16]


def _cases():
    out = []
    for i, (lq, lk, d) in enumerate(GRID):
        for mode in MODES:
            for causal in (False, True):
                out.append(pytest.param(lq, lk, d, mode, causal, i % 4 == 0,
                                        id=f"{lq}x{lk}-d{d}-{mode}-{'causal' if causal else 'full'}"
                                           f"{'-sinks' if i % 4 == 0 else ''}"))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lq,lk,d,mode,causal,sinks", _cases())
def test_accuracy_grid(backend, dtype, lq, lk, d, mode, causal, sinks):
    q, k, v = make_qkv(B=2, Hq=4, Hkv=2, Lq=lq, Lk=lk, D=d, dtype=dtype, device="cuda", seed=lq + lk + d)
    variant = VARIANTS[mode]
    spec = AttentionSpec(scale=d ** -0.5, score=variant.score.name, causal=causal, group=2,
                         adaptive=variant.adaptive)
    sink = torch.linspace(-1.0, 1.0, 4, device="cuda", dtype=torch.float32).requires_grad_() if sinks else None
    why = get(backend).supports(q, k, v, spec, sink)
    if why is not None:
        pytest.skip(why)
    kw = dict(is_causal=causal, enable_gqa=True)
    if sinks:
        kw["sinks"] = sink
    check(mode, q, k, v, backend=backend, **kw)
