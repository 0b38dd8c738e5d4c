"""The CUDA verdict matrix: every kernel family the CUDA C++ backend dispatches to, once, against
the float64 specification with FlashAttention's rule (``attn_testing.check`` / ``compare``), so that
one short GPU step (``bench/run_gpu.sh``, step ``cuda-matrix``: well under two minutes once the
extension is built) says whether the CUDA kernels compute the right thing on that GPU.

The matrix: head dim x dtype x bundle x variant.

* head dims ``HEAD_DIMS``: 64 and 128 run the sm_90a wgmma kernels on an H100 / H200 (csrc/arch.h,
  ``SSA_FLASH_WGMMA``; every other GPU runs the mma.sync code everywhere), 80 (padded to 96), 32
  and 256 the mma.sync code on every GPU; 256 has no fused backward (csrc/traits.h,
  ``bwd_fused_for``);
* dtypes float16 and bfloat16;
* bundles (``BUNDLES``), each several features at once: which backward a bundle takes is in its
  name, ``fused`` (the pre-pass and one kernel, dQ by atomics) or ``2k`` (the dQ kernel and the
  dK/dV kernel: ``deterministic=True``, dropout or a window); masks (boolean with a row that
  admits no key, additive with -inf), causality (Lq < Lk and Lq > Lk), GQA, dropout, local
  windows, attention sinks and logit soft-capping (the ``SSA_FLASH_EXTRAS`` instances), the LSE's
  gradient, and the row-entropy kernel (``entropy``);
* variants: all four at head dims 64 and 128, two (one of softmax scores, one of SSA's, rotating)
  elsewhere.

``SMOKE_ROWS`` are in the GPU smoke tier too (``-m gpu_smoke``).

Without a GPU the rows marked ``CPU_ROWS`` run through the CPU emulation of the kernels
(``emulation.py``: float16, head dims up to 32, smaller shapes), so that the matrix's own code is
checked here before a GPU session depends on it; the others skip ("GPU only").
"""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import ssa_flash
from attn_testing import CUDA, DEVICE, FLOORS, MODES, check, fa_tolerance_check, head_params, make_qkv
from emulation import cuda_backend_context
from ssa_flash import reference

pytestmark = pytest.mark.cuda

HEAD_DIMS = (64, 128, 80, 32, 256)
WGMMA_DIMS = (64, 128)  # all four variants here: the sm_90a kernels' own code
DTYPES = ("fp16", "bf16")
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Bundle(NamedTuple):
    gqa: bool = False
    causal: bool = False
    mask: str = ""  # "", "bool" (row 5 admits no key), "add" (-inf entries)
    lq_lk: tuple = (130, 200)
    dropout: float = 0.0
    window: tuple = (-1, -1)
    deterministic: bool = False
    sinks: bool = False
    softcap: float = 0.0
    dlse: bool = True
    entropy: bool = False


BUNDLES = {
    "fused-plain": Bundle(dlse=False),
    "fused-causal-gqa-boolmask": Bundle(gqa=True, causal=True, mask="bool"),
    "fused-sinks-softcap-causal": Bundle(gqa=True, causal=True, sinks=True, softcap=2.0),
    "2k-deterministic-addmask-lq>lk": Bundle(mask="add", lq_lk=(200, 130), causal=True, deterministic=True),
    "2k-dropout-gqa-boolmask": Bundle(gqa=True, mask="bool", dropout=0.2),
    "2k-window-causal": Bundle(causal=True, window=(40, 9)),
    "2k-sinks-softcap-window-dropout": Bundle(sinks=True, softcap=1.5, window=(60, 20), dropout=0.15),
    "entropy-gqa-boolmask-window": Bundle(gqa=True, causal=True, mask="bool", window=(50, -1), entropy=True),
}

# (head dim, dtype, bundle, variant) rows that the CPU runs through the emulator (at head dim 32)
CPU_ROWS = {
    (64, "fp16", "fused-causal-gqa-boolmask", "ssa_adaptive"),
    (64, "fp16", "2k-dropout-gqa-boolmask", "adaptive"),
    (128, "fp16", "2k-sinks-softcap-window-dropout", "ssa"),
    (128, "fp16", "entropy-gqa-boolmask-window", "ssa"),
}


# also in the GPU smoke tier (`pytest -m gpu_smoke tests`: tests/gpu_smoke's dense cases all take the
# two-kernel backward at padded head dim 64): the fused backward at head dim 128 in bfloat16 (on an
# H100 / H200 the wgmma kernels), with and without sinks and soft-capping
SMOKE_ROWS = {(128, "bf16", "fused-causal-gqa-boolmask"), (128, "bf16", "fused-sinks-softcap-causal")}


def _rows():
    rows = []
    for d in HEAD_DIMS:
        for dt in DTYPES:
            for i, name in enumerate(BUNDLES):
                modes = MODES if d in WGMMA_DIMS else [MODES[(i + j) % 4] for j in (0, 1)]
                if BUNDLES[name].entropy:  # no variant: plain or SSA logits
                    modes = ["softmax", "ssa"] if d in WGMMA_DIMS else [modes[0]]
                    modes = ["ssa" if "ssa" in m else "softmax" for m in modes]
                marks = [pytest.mark.gpu_smoke] if (d, dt, name) in SMOKE_ROWS else []
                rows += [pytest.param(d, dt, name, m, id=f"d{d}-{dt}-{name}-{m}", marks=marks) for m in modes]
    return rows


ROWS = _rows()


@pytest.fixture(scope="module")
def runs_on():
    """The extension on a GPU (skipped with its reason when unavailable: a failure under
    ``SSA_FLASH_REQUIRE_CUDA=1``, tests/conftest.py), the emulator on the CPU."""
    return cuda_backend_context()


def _inputs(d, dtype, bundle: Bundle):
    if CUDA:
        B, Hq, Hkv = 2, 4, 2 if bundle.gqa else 4
        Lq, Lk = bundle.lq_lk
        window = bundle.window
    else:  # the emulator: one program at a time, head dims up to 32
        B, Hq, Hkv = 1, 2, 1 if bundle.gqa else 2
        Lq, Lk = (23, 37) if bundle.lq_lk[0] < bundle.lq_lk[1] else (37, 23)
        d = min(d, 32)
        window = tuple(w if w < 0 else max(1, w // 5) for w in bundle.window)
    q, k, v = make_qkv(B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, D=d, dtype=dtype, q_scale=1.5, seed=d,
                       requires_grad=not bundle.entropy)
    g = torch.Generator().manual_seed(17)
    kw = dict(is_causal=bundle.causal)
    if bundle.gqa:
        kw["enable_gqa"] = True
    if bundle.mask == "bool":
        mask = torch.rand(B, 1, Lq, Lk, generator=g) > 0.25
        mask[:, :, 5] = False
        kw["attn_mask"] = mask.to(DEVICE)
    elif bundle.mask == "add":
        mask = torch.randn(1, Hq, Lq, Lk, generator=g)
        mask[torch.rand(mask.shape, generator=g) < 0.2] = float("-inf")
        kw["attn_mask"] = mask.to(DEVICE, dtype)
    if window != (-1, -1):
        kw["window_size"] = window
    if bundle.sinks:
        kw["sinks"] = (torch.randn(Hq, generator=g, dtype=torch.float64) * 1.5).to(DEVICE, torch.float32)
    if bundle.softcap:
        kw["softcap"] = bundle.softcap
    return q, k, v, kw


@pytest.mark.parametrize("d,dt,bundle,mode", ROWS)
def test_cuda_matrix(request, d, dt, bundle, mode):
    if not CUDA and (d, dt, bundle, mode) not in CPU_ROWS:
        pytest.skip("GPU only (without a GPU, CPU_ROWS run through the emulator)")
    runs_on = request.getfixturevalue("runs_on")  # (after the skip: the emulator is not built for it)
    dtype = TORCH_DTYPES[dt]
    if CUDA and dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("bfloat16 needs sm_80")
    b_ = BUNDLES[bundle]
    q, k, v, kw = _inputs(d, dtype, b_)
    if b_.entropy:
        bn = {}
        if mode == "ssa":
            b, n = (t.detach() for t in head_params(q.shape[1]))
            bn = dict(b=b, n=n)
        with runs_on():
            ours = ssa_flash.attention_entropy(q, k, backend="cuda", **kw,
                                               **(dict(score="ssa", score_params=bn) if bn else {}))
        score = dict(score="ssa", score_params=bn) if bn else {}
        naive = reference.attention_entropy(q, k, **kw, **score)
        gold_kw = {key: (val.double() if torch.is_tensor(val) and val.is_floating_point() else val)
                   for key, val in kw.items()}
        gold_bn = {key: val.double() for key, val in bn.items()}
        gold = reference.attention_entropy(q.double(), k.double(), **gold_kw,
                                           **(dict(score="ssa", score_params=gold_bn) if bn else {}))
        assert ours.dtype == torch.float32 and ours.shape == q.shape[:-1]
        fa_tolerance_check("entropy", ours, naive, gold, FLOORS[dtype])
        return
    if b_.deterministic:
        kw["deterministic"] = True
    if b_.dropout:
        kw["dropout_p"] = b_.dropout
    with runs_on():
        out, _, grads = check(mode, q, k, v, with_dlse=b_.dlse, dropout_seed=11 if b_.dropout else None,
                              backend="cuda", **kw)
    assert set(grads) == ({"q", "k", "v", "b", "n"} if "ssa" in mode else {"q", "k", "v"})
    if b_.mask == "bool" and not b_.sinks:  # the row the mask removes entirely
        assert (out[:, :, 5] == 0).all() and (grads["q"][:, :, 5] == 0).all()
