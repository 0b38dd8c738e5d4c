"""The logit scale (``phi(z) = s_h z``, ``ssa_flash.scores.LOGIT_SCALE``) through the Triton kernels
(interpreter on the CPU), float64: forward, LSE and the gradients of q, k, v, s and the sinks
against a few lines of torch (autograd of the formula), gradcheck, ``s = 0``, and the layouts the
launcher handles itself (packed batch, KV cache with split-KV)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ssa_flash
from ssa_flash import autograd as ssa_autograd
from ssa_flash import scores
from ssa_flash.spec import AttentionSpec

from attn_testing import DEVICE, needs_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = needs_kernels

F64 = torch.float64


def _torch_attention(q, k, v, s, scale, causal=False, mask=None, softcap=0.0, sinks=None, window=None,
                     bottom_right=False):
    """``(out, lse)`` of ``softmax(s_h z' + mask)`` (``z' = c tanh(z / c)`` under the cap), the
    sink ``[l, sinks_h]`` appended with a zero value; GQA by repeating k, v. Rows with nothing
    admissible: out 0, lse -inf."""
    Hq, Lq, Lk = q.shape[1], q.shape[2], k.shape[2]
    k, v = (x.repeat_interleave(Hq // x.shape[1], dim=1) for x in (k, v))
    z = scale * q @ k.transpose(-1, -2)
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    logits = s[:, None, None] * z
    i = torch.arange(Lq, device=q.device)[:, None] + (Lk - Lq if bottom_right else 0)
    j = torch.arange(Lk, device=q.device)[None, :]
    keep = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window[0]) & (j <= i + window[1])
    logits = logits.masked_fill(~keep, float("-inf"))
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    if sinks is not None:
        logits = torch.cat([logits, sinks[:, None, None].expand(*logits.shape[:-1], 1)], dim=-1)
        v = torch.cat([v, torch.zeros_like(v[..., :1, :])], dim=-2)
    empty = (logits == float("-inf")).all(dim=-1, keepdim=True)
    logits = logits.masked_fill(empty, 0.0)  # (no NaN in the backward of an empty row)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    p = torch.exp(logits - lse).masked_fill(empty, 0.0)
    return p @ v, lse.masked_fill(empty, float("-inf")).squeeze(-1)


def _inputs(B=2, Hq=4, Hkv=2, Lq=37, Lk=37, D=16, seed=0, q_scale=1.5, s_values=None):
    g = torch.Generator().manual_seed(seed)
    q = q_scale * torch.randn(B, Hq, Lq, D, generator=g, dtype=F64)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=F64)
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=F64)
    s = (0.3 + 1.5 * torch.rand(Hq, generator=g, dtype=F64)) if s_values is None else torch.tensor(s_values, dtype=F64)
    return [x.to(DEVICE).requires_grad_() for x in (q, k, v, s)]


def _upstream(out, lse):
    """A fixed weighting of out and of the finite part of lse, whose gradients are compared."""
    dout = torch.cos(torch.arange(out.numel(), dtype=out.dtype, device=out.device)).view_as(out)
    dlse = torch.sin(torch.arange(lse.numel(), dtype=lse.dtype, device=lse.device)).view_as(lse)
    return (out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()


def _check(ours, theirs, wrt, names, tol=1e-10):
    g_ours = torch.autograd.grad(_upstream(*ours), wrt)
    g_theirs = torch.autograd.grad(_upstream(*theirs), wrt)
    for name, a, b in zip(["out", "lse"] + names, list(ours) + list(g_ours), list(theirs) + list(g_theirs)):
        assert torch.isfinite(a).logical_or(torch.isneginf(b)).all(), name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


CASES = {
    "plain": dict(),
    "causal_gqa_negative_scale": dict(is_causal=True, scale=-0.3),
    "bool_mask": dict(mask="bool"),
    "additive_mask_softcap": dict(mask="additive", softcap=2.0),
    "sinks_softcap_causal_negative_scale": dict(sinks=True, softcap=1.3, is_causal=True, scale=-0.35),
    "window": dict(window_size=(5, 3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch(case):
    """Lengths spanning several kernel blocks (interior and ragged tiles), GQA (2 query heads per
    key/value head), every gradient: the kernels against torch's autograd of the formula."""
    opts = dict(CASES[case])
    q, k, v, s = _inputs()
    Lq, Lk = q.shape[2], k.shape[2]
    g = torch.Generator().manual_seed(1)
    kw = dict(is_causal=opts.get("is_causal", False), softcap=opts.get("softcap", 0.0), enable_gqa=True)
    if "scale" in opts:
        kw["scale"] = opts["scale"]
    scale = opts.get("scale", q.shape[-1] ** -0.5)
    mask = None
    if opts.get("mask") == "bool":
        mask = torch.rand(Lq, Lk, generator=g) > 0.3
        mask[3] = False  # an empty row
        mask = mask.to(DEVICE)
    elif opts.get("mask") == "additive":
        mask = torch.randn(1, 4, Lq, Lk, generator=g, dtype=F64).to(DEVICE)
        mask[..., 5, :] = float("-inf")
    sinks = None
    wrt = [q, k, v, s]
    names = ["dq", "dk", "dv", "ds"]
    if opts.get("sinks"):
        sinks = torch.randn(4, generator=g, dtype=F64).to(DEVICE).requires_grad_()
        wrt.append(sinks)
        names.append("dsinks")
    window = opts.get("window_size")
    ours = ssa_flash.attention(q, k, v, mask, score="logit_scale", score_params={"s": s}, backend="triton",
                               return_lse=True, sinks=sinks, window_size=window or (-1, -1), **kw)
    theirs = _torch_attention(q, k, v, s, scale, kw["is_causal"], mask, kw["softcap"], sinks, window)
    _check(ours, theirs, wrt, names)


@pytest.mark.parametrize("adaptive", [False, True])
def test_zero_scale_gives_uniform_weights(adaptive):
    """``s_h = 0``: every admissible key weighs the same (the mean of their values; the
    temperature multiplies a zero logit), finite gradients equal to torch's, in particular ``ds``
    (which needs no division by ``s_h``) and ``dq = dk = 0`` for that head."""
    q, k, v, s = _inputs(B=1, Hq=2, Hkv=2, Lq=21, Lk=21, s_values=[0.0, 0.0])
    out, lse = ssa_flash.attention(q, k, v, score="logit_scale", score_params={"s": s}, is_causal=True,
                                   adaptive_temperature=adaptive, backend="triton", return_lse=True)
    counts = torch.arange(1, 22, dtype=F64, device=DEVICE)
    mean = v.detach().cumsum(dim=2) / counts[:, None]
    torch.testing.assert_close(out.detach(), mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse.detach(), torch.log(counts).expand_as(lse), rtol=1e-12, atol=1e-12)
    dq, dk, dv, ds = torch.autograd.grad(_upstream(out, lse), (q, k, v, s))
    assert all(torch.isfinite(x).all() for x in (dq, dk, dv, ds))
    assert dq.abs().max() == 0 and dk.abs().max() == 0
    if not adaptive:
        theirs = _torch_attention(q, k, v, s, q.shape[-1] ** -0.5, causal=True)
        ref = torch.autograd.grad(_upstream(*theirs), (q, k, v, s))
        for a, b in zip((dq, dk, dv, ds), ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert ds.abs().max() > 0  # the scale's gradient at 0 is not degenerate


@pytest.mark.parametrize("case", ["causal_gqa_softcap", "bool_mask_adaptive", "additive_mask_adaptive_softcap"])
def test_gradcheck(case):
    """float64 gradcheck of q, k, v, s on tiny inputs; random projections (fast mode) except the
    adaptive temperature with a boolean mask, the full Jacobian (every gradient path, through
    beta)."""
    Hq, Hkv, Lq, Lk, D = (2, 1, 4, 3, 2) if case == "causal_gqa_softcap" else (2, 2, 3, 4, 2)
    q, k, v, s = _inputs(B=1, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D, q_scale=2.5)
    kw = dict(backend="triton", adaptive_temperature="adaptive" in case)
    if case == "causal_gqa_softcap":
        kw.update(is_causal=True, enable_gqa=True, softcap=1.5)
    elif case == "bool_mask_adaptive":
        m = torch.rand(Lq, Lk, generator=torch.Generator().manual_seed(0)) > 0.4
        m[1] = False  # one empty row
        m[0, 0] = True
        kw["attn_mask"] = m.to(DEVICE)
    else:
        m = torch.randn(1, Hq, Lq, Lk, generator=torch.Generator().manual_seed(0), dtype=F64)
        m[..., 2, :2] = float("-inf")
        kw.update(attn_mask=m.to(DEVICE), softcap=1.5)

    def f(q, k, v, s):
        out, lse = ssa_flash.attention(q, k, v, score="logit_scale", score_params={"s": s}, return_lse=True, **kw)
        return out, torch.where(torch.isfinite(lse), lse, 0)

    assert torch.autograd.gradcheck(f, (q, k, v, s), eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=case != "bool_mask_adaptive")


def _spec(**kw):
    return AttentionSpec(scale=0.4, score="logit_scale", **kw)


def test_packed_batch():
    """A packed variable-length batch (causal, GQA), one sequence without keys for its queries:
    forward and gradients against torch per sequence."""
    q, k, v, s = _inputs(B=1, Hq=2, Hkv=1, Lq=11, Lk=11)
    pack = [x.detach()[0].transpose(0, 1).contiguous().requires_grad_() for x in (q, k, v)]
    cu_q = torch.tensor([0, 4, 6, 11], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 5, 5, 11], dtype=torch.int32, device=DEVICE)
    spec = _spec(group=2, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6)
    out, lse = ssa_autograd.attention(*pack, (s,), None, "triton", spec)
    outs, lses = [], []
    for i in range(3):
        a, b, c, d = cu_q[i].item(), cu_q[i + 1].item(), cu_k[i].item(), cu_k[i + 1].item()
        qi, ki, vi = (x[lo:hi].transpose(0, 1)[None]
                      for x, lo, hi in ((pack[0], a, b), (pack[1], c, d), (pack[2], c, d)))
        # causality top-left within a sequence (docs of ssa_flash.reference.varlen_attention)
        o, l = _torch_attention(qi, ki, vi, s, 0.4, causal=True) if d > c else (
            torch.zeros_like(qi), torch.full(qi.shape[:-1], float("-inf"), dtype=F64, device=DEVICE))
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    theirs = (torch.cat(outs), torch.cat(lses, dim=1))
    _check((out, lse), theirs, pack + [s], ["dq", "dk", "dv", "ds"])


@pytest.mark.parametrize("splits", [1, 3])
def test_kvcache_split_kv(splits):
    """Decoding on a KV cache with the keys split among programs (merged on the host), with a
    sink; one cache empty. Output, LSE and the statistics pass's entropy against torch."""
    q, k, v, s = (x.detach() for x in _inputs(B=2, Hq=2, Hkv=1, Lq=2, Lk=40))
    sinks = torch.tensor([0.3, -0.7], dtype=F64, device=DEVICE)
    used = torch.tensor([37, 0], dtype=torch.int32, device=DEVICE)
    spec = _spec(group=2, causal=True, seqused_k=used, num_splits=splits, softcap=1.7)
    out, lse = ssa_autograd.attention(q, k, v, (s,), None, "triton", spec, sinks=sinks)
    ent = ssa_autograd.row_entropy(q, k, (s,), None, "triton", spec, sinks=sinks)
    o0, l0 = _torch_attention(q[:1], k[:1, :, :37], v[:1, :, :37], s, 0.4, causal=True, softcap=1.7, sinks=sinks,
                              bottom_right=True)
    torch.testing.assert_close(out[:1], o0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse[:1], l0, rtol=1e-10, atol=1e-10)
    assert out[1].abs().max() == 0
    torch.testing.assert_close(lse[1], sinks[:, None].expand(2, 2))
    # the entropy of [l, sink] (temperature-free)
    logits = torch.cat([s[:, None, None] * 1.7 * torch.tanh(0.4 * q[0] @ k[0, :, :37].repeat(2, 1, 1).transpose(-1, -2)
                                                         / 1.7), sinks[:, None, None].expand(2, 2, 1)], dim=-1)
    i = torch.arange(2, device=DEVICE)[:, None] + 35
    logits[..., :37] = logits[..., :37].masked_fill(torch.arange(37, device=DEVICE)[None, :] > i, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    expected = -(torch.where(p > 0, p * torch.log(p), 0.0)).sum(-1)
    torch.testing.assert_close(ent[0], expected, rtol=1e-10, atol=1e-10)


def test_dropout_and_adaptive_match_the_reference():
    """Dropout (the kernels' Philox mask) with the adaptive temperature and a window: against the
    reference backend (the registry's phi), every gradient."""
    q, k, v, s = _inputs(B=1, Hq=2, Hkv=2, Lq=33, Lk=33)
    kw = dict(score="logit_scale", score_params={"s": s}, dropout_p=0.3, adaptive_temperature=True,
              window_size=(6, 0), is_causal=True, return_lse=True)
    results = []
    for backend in ("triton", "reference"):
        torch.manual_seed(5)
        out, lse = ssa_flash.attention(q, k, v, backend=backend, **kw)
        results.append([out, lse] + list(torch.autograd.grad(_upstream(out, lse), (q, k, v, s))))
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "ds"], *results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


def test_a_score_function_without_its_maths_does_not_compile(tmp_path):
    """A registry id that ``triton/logits.py`` has no branches for fails to compile (it must not run
    as softmax, the helpers' default branch). In a fresh process with an empty Triton cache: on a
    GPU a kernel compiled (or kept for direct launch) before the id changed would just run again."""
    script = textwrap.dedent("""
        import torch
        from ssa_flash import autograd as ssa_autograd
        from ssa_flash.spec import AttentionSpec
        from ssa_flash.triton import kernel_args, logits

        logits.LOGIT_SCALE_ID.value = 99  # id 2 without its branches, before anything compiles
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        q = torch.randn(1, 2, 8, 16, dtype=torch.float32, device=dev)
        s = torch.ones(2, dtype=torch.float32, device=dev)
        try:
            ssa_autograd.attention(q, q, q, (s,), None, "triton", AttentionSpec(scale=0.25, score="logit_scale"))
        except Exception as err:
            print("raised:", type(err).__name__, err)
        else:
            print("ran")
        """)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "raised:" in proc.stdout and "no maths for this score function id" in proc.stdout, proc.stdout[-3000:]


def test_kernels_are_compiled_per_score_function():
    """The launcher compiles the kernels for ``SCORE = score.id`` and passes the parameters as
    ``P0, P1`` (a dummy for the missing one); a wrong number of parameters is a ValueError."""
    from ssa_flash.triton import kernel_args, launch

    q = torch.empty(1, 2, 64, 64, device="meta", dtype=torch.float16)
    s = torch.empty(2, device="meta", dtype=torch.float32)
    for score, params in ((scores.LOGIT_SCALE, (s,)), (scores.SSA, (s, s)), (scores.SOFTMAX, ())):
        spec = AttentionSpec(scale=0.125, score=score.name)
        with launch.capture_launches(90) as cap:
            o, lse = launch.forward(q, q, q, None, params, None, spec)
            grads = launch.backward(o, q, q, q, o, lse, None, None, params, None, spec)
        assert [kl.constexprs["SCORE"] for kl in cap] == [score.id] * 3
        assert len(grads[3]) == len(score.params)
        fwd = cap[0]
        p0, p1 = fwd.args[kernel_args.PARAMS["fwd"].index("score_params")]
        assert (p0 is s) == bool(score.params) and (p1 is s) == (len(score.params) == 2)
    with pytest.raises(ValueError, match="logit_scale"):
        launch.forward(q, q, q, None, (s, s), None, AttentionSpec(scale=0.125, score="logit_scale"))
