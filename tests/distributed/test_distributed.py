"""Ring attention (ssa_flash.distributed) on 2 and 4 CPU processes over gloo, against the
single-process specification (ssa_flash.reference) on the whole tensors: outputs and gradients of
q, k, v, b, n; causal (zig-zag) and not; every variant; GQA; the nn.Module under DDP; a failing
rank. Each test is one spawn running several checks (process start-up dominates on the CPU).

Tolerances: float64 everywhere here, so the only differences are the order of sums: 1e-10
relative (1e-9 for the b, n reductions).
"""
from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import ssa_flash.distributed as sfd
from ssa_flash import nn as ssa_nn
from ssa_flash import reference

from attn_testing import INTERPRETER, MODES
from dist_harness import spawn

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
# The ranks here hold CPU tensors (gloo), so the Triton kernels run only through the interpreter.
# GPU / NCCL runs are not part of this suite (docs/distributed.md).
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="multi-process tests run the Triton kernels on CPU "
                                       "tensors: needs TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-10


def _close(name, ours, ref, tol=TOL):
    ours, ref = ours.detach().double(), ref.detach().double()
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    err = (ours - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), f"{name}: max error {err:.3g}"


def _case(mode, causal, world, hkv, chunk=5, Hq=2, D=8, seed=0):
    """Whole-sequence inputs (identical on every rank: same seed) and the reference's output and
    gradients of ``sum(out * dout)``."""
    g = torch.Generator().manual_seed(seed)
    L = 2 * world * chunk
    q = 1.5 * torch.randn(1, Hq, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, hkv, L, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, hkv, L, D, generator=g, dtype=torch.float64)
    dout = torch.randn(1, Hq, L, D, generator=g, dtype=torch.float64)
    b = 0.5 + torch.rand(Hq, generator=g, dtype=torch.float64)
    n = 1.0 + 1.5 * torch.rand(Hq, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, b, n)]
    rq, rk, rv, rb, rn = leaves
    kw = dict(is_causal=causal, enable_gqa=hkv != Hq)
    if mode == "softmax":
        out = reference.attention(rq, rk, rv, **kw)
    elif mode == "adaptive":
        out = reference.attention(rq, rk, rv, **kw, adaptive_temperature=True)
    else:
        out = reference.attention(rq, rk, rv, score="ssa", score_params=(rb, rn),
                                  adaptive_temperature=mode == "ssa_adaptive", **kw)
    if "adaptive" in mode:  # the temperature must be active on some rows
        ent = reference.attention_entropy(rq, rk, **kw, **({"score": "ssa", "score_params": (rb, rn)} if "ssa" in mode
                                                           else {}))
        assert (ent > 1.0).any()
    (out * dout).sum().backward()
    grads = [t.grad for t in leaves]
    return (q, k, v, dout, b, n), out.detach(), grads


LOW_TOL = {torch.float32: 2e-5, torch.float16: 1e-2}  # relative, against the float64 reference


def _check_ring(rank, world, mode, causal, hkv, backend, dtype=torch.float64, bshd=False):
    """``bshd``: the inputs are sharded in a (B, L, H, D) layout (``dim=1``) and transposed to
    (B, H, L/W, D) views, so the ring gets non-contiguous shards."""
    (q, k, v, dout, b, n), out_ref, grads_ref = _case(mode, causal, world, hkv)
    shard = lambda t: sfd.shard_sequence(t, None, 2, causal)  # noqa: E731
    if bshd:
        leaves = [sfd.shard_sequence(t.transpose(1, 2).contiguous(), None, 1, causal).to(dtype).requires_grad_()
                  for t in (q, k, v)]
        ql, kl, vl = (t.transpose(1, 2) for t in leaves)
        assert not ql.is_contiguous()
    else:
        leaves = [shard(t).to(dtype).requires_grad_() for t in (q, k, v)]
        ql, kl, vl = leaves
    bl, nl = b.clone().requires_grad_(), n.clone().requires_grad_()
    ssa = "ssa" in mode
    out = sfd.ring_attention(ql, kl, vl, None, causal, None, hkv != q.shape[1], score="ssa" if ssa else "softmax",
                             score_params=(bl, nl) if ssa else None,
                             adaptive_temperature="adaptive" in mode, backend=backend)
    assert out.dtype == dtype
    (out.double() * shard(dout)).sum().backward()
    tol = TOL if dtype == torch.float64 else LOW_TOL[dtype]
    tag = f"rank {rank}/{world} {mode} causal={causal} hkv={hkv} {backend} {dtype} bshd={bshd}"
    _close(f"{tag}: out", out, shard(out_ref), tol)
    _close(f"{tag}: unshard(out)", sfd.unshard_sequence(out, None, 2, causal), out_ref, tol)
    for name, leaf, ref in zip("qkv", leaves, grads_ref[:3]):
        grad = leaf.grad.transpose(1, 2) if bshd else leaf.grad
        _close(f"{tag}: d{name}", grad, shard(ref), tol)
    if ssa:
        for name, ours, ref in zip("bn", (bl, nl), grads_ref[3:]):
            _close(f"{tag}: d{name}", ours.grad, ref, 10 * tol)
            every = [torch.empty_like(ours.grad) for _ in range(world)]
            dist.all_gather(every, ours.grad)
            assert all(torch.equal(x, every[0]) for x in every), f"{tag}: d{name} differs between ranks"
    else:
        assert bl.grad is None and nl.grad is None


def _ring_cases(rank, world, cases):
    for case in cases:
        _check_ring(rank, world, *case)


@needs_gloo
@needs_interpreter
def test_ring_triton_two_ranks():
    """2 ranks, Triton kernels (interpreter on the CPU): every variant, causal and not, float64;
    GQA in half of the cases; then float32 on non-contiguous (B, L, H, D)-sharded inputs and
    float16, SSA + adaptive, causal."""
    cases = [(mode, causal, 1 if causal else 2, "triton") for mode in MODES for causal in (False, True)]
    cases += [("ssa_adaptive", True, 1, "triton", torch.float32, True),
              ("ssa_adaptive", True, 2, "triton", torch.float16)]
    spawn(_ring_cases, 2, cases)


@needs_gloo
def test_ring_four_ranks():
    """4 ranks: every variant causal (zig-zag: diagonal, lower and higher shards) through the
    reference backend's explicit formulas (the same backend interface as the kernels, without
    the interpreter's cost on 4 processes), SSA + adaptive not causal with GQA, and one causal
    SSA + adaptive case through the Triton kernels where they run."""
    cases = [(mode, True, 2, "reference") for mode in MODES] + [("ssa_adaptive", False, 1, "reference")]
    if INTERPRETER:
        cases.append(("ssa_adaptive", True, 1, "triton"))
    spawn(_ring_cases, 4, cases)


# --------------------------------------------------------------------------------------------
# nn.Module form, DDP


def _module_checks(rank, world, causal):
    (q, k, v, dout, _, _), _, _ = _case("ssa", causal, world, 2)
    torch.manual_seed(0)
    b0, n0 = [0.7, 1.3], [1.4, 2.0]
    ref = ssa_nn.SSAttention(2, b0, n0, backend="reference").double()
    (ref(q, k, v, is_causal=causal) * dout).sum().backward()
    shard = lambda t: sfd.shard_sequence(t, None, 2, causal)  # noqa: E731
    ql, kl, vl, dl = (shard(t) for t in (q, k, v, dout))

    # under DDP (reduce_param_grads=False, the default): b, n reduced once, by DDP, averaged like
    # every other parameter's gradient: (1/W) of the gradient of the sum of the ranks' losses
    attn = sfd.RingSSAttention(2, b0, n0, is_causal=causal, backend="reference").double()
    ddp = torch.nn.parallel.DistributedDataParallel(attn)
    out = ddp(ql, kl, vl)
    (out * dl).sum().backward()
    _close("DDP out", out, shard(ref(q, k, v, is_causal=causal)))
    for name in ("b_raw", "n_raw"):
        _close(f"DDP d{name}", getattr(attn, name).grad, getattr(ref, name).grad / world, 10 * TOL)

    # FSDP2 (fully_shard): b_raw, n_raw sharded over the ranks, gradients reduce-scattered (averaged)
    from torch.distributed.fsdp import fully_shard

    attn = sfd.RingSSAttention(2, b0, n0, is_causal=causal, backend="reference").double()
    fully_shard(attn)
    (attn(ql, kl, vl) * dl).sum().backward()
    for name in ("b_raw", "n_raw"):
        _close(f"FSDP d{name}", getattr(attn, name).grad.full_tensor(), getattr(ref, name).grad / world, 10 * TOL)

    # without a wrapper, reduce_param_grads=True: every rank gets the whole gradient
    attn = sfd.RingSSAttention(2, b0, n0, is_causal=causal, backend="reference", reduce_param_grads=True).double()
    (attn(ql, kl, vl) * dl).sum().backward()
    for name in ("b_raw", "n_raw"):
        _close(f"d{name}", getattr(attn, name).grad, getattr(ref, name).grad, 10 * TOL)
    assert attn.state_dict().keys() == ref.state_dict().keys()
    chunk = 2  # 8 positions in 2 * world chunks: zig-zag (r, 2W-1-r) when causal
    expected = [p for c in (rank, 2 * world - 1 - rank) for p in range(c * chunk, (c + 1) * chunk)]
    assert sfd.shard_positions(8, is_causal=True).tolist() == expected
    assert sfd.shard_positions(8).tolist() == list(range(rank * 4, rank * 4 + 4))


@needs_gloo
def test_ring_module_under_ddp_and_fsdp():
    """RingSSAttention (causal, 2 ranks) under DDP and FSDP2: b, n gradients scaled like every
    other parameter's (averaged over the ranks); on its own with reduce_param_grads=True: the
    whole gradient on every rank. The same state dict as SSAttention."""
    spawn(_module_checks, 2, True)


# --------------------------------------------------------------------------------------------
# Failures: raise on every rank, never hang


def _one_rank_fails(rank, world, results_dir, group_timeout_s):
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    # the group under test, with the short timeout, made once both ranks are here (the default
    # group's timeout is a hang catcher: joining it may take long on a loaded machine)
    dist.barrier()
    group = dist.new_group(ranks=list(range(world)), timeout=datetime.timedelta(seconds=group_timeout_s))
    try:
        if rank == 1:  # a bad argument on one rank only: it raises before communicating
            sfd.ring_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], group=group, is_causal=True,
                               backend="reference", score="ssa", score_params=(1.0, 1.5))
        else:  # the other waits for a shard that never comes
            sfd.ring_attention(q, q, q, group=group, is_causal=True, backend="reference", score="ssa",
                               score_params=(1.0, 1.5))
    except Exception as err:  # noqa: BLE001
        outcome = f"{type(err).__name__}: {err}".replace("\n", " ")
    else:
        outcome = "no error"
    with open(os.path.join(results_dir, f"rank{rank}"), "w") as fh:
        fh.write(outcome)
    if rank == 1:  # stays in the group without communicating until the other has given up
        while not os.path.exists(os.path.join(results_dir, "rank0")):  # (spawn's timeout catches a hang)
            time.sleep(0.2)


@needs_gloo
def test_failing_rank_raises_everywhere(tmp_path):
    """One rank fails on a bad argument (a ValueError naming it) and then stays alive without
    communicating; the rank waiting on it raises at the process group's timeout (10 s here)
    instead of hanging. (A failed rank that exits makes the others' receives fail at once.) The
    verdict does not depend on the machine's speed: the failed rank stays until the other has
    raised, so the other's error can only be the timeout's."""
    spawn(_one_rank_fails, 2, str(tmp_path), 10.0)
    r0 = (tmp_path / "rank0").read_text()
    r1 = (tmp_path / "rank1").read_text()
    assert r1.startswith("ValueError") and "is_causal" in r1, r1
    assert r0 != "no error" and "timed out" in r0.lower(), r0


# --------------------------------------------------------------------------------------------
# One process: a ring of one rank, argument errors


@pytest.fixture
def single_rank_group(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@needs_gloo
def test_errors_name_the_argument(single_rank_group):
    x = torch.zeros(1, 2, 6, 4)
    with pytest.raises(TypeError, match="group"):
        sfd.ring_attention(x, x, x, group="world", score="ssa", score_params=(1.0, 1.5))
    with pytest.raises(ValueError, match="is_causal.*even"):
        sfd.ring_attention(x[:, :, :5], x[:, :, :5], x[:, :, :5], is_causal=True, backend="reference", score="ssa",
                           score_params=(1.0, 1.5))
    with pytest.raises(ValueError, match="is_causal.*query length 6, key length 4"):
        sfd.ring_attention(x, x[:, :, :4], x[:, :, :4], is_causal=True, backend="reference", score="ssa",
                           score_params=(1.0, 1.5))
    with pytest.raises(ValueError, match=r"query must have 4 dims \(B, H, L/W, D\)"):
        sfd.ring_attention(x[0], x[0], x[0], score="ssa", score_params=(1.0, 1.5))
    with pytest.raises(TypeError, match="adaptive_temperature"):
        sfd.ring_attention(x, x, x, adaptive_temperature=1, score="ssa", score_params=(1.0, 1.5))
    with pytest.raises(ValueError, match="b must"):
        sfd.ring_attention(x, x, x, score="ssa", score_params=(-1.0, 1.5), backend="reference")
    with pytest.raises(ValueError, match="enable_gqa"):
        sfd.ring_attention(x, x[:, :1], x[:, :1], backend="reference", score="ssa", score_params=(1.0, 1.5))
    with pytest.raises(ValueError, match=r"x: sequence length 5 \(dim 2\) must be a positive multiple of 2 \* world"):
        sfd.shard_sequence(torch.zeros(1, 2, 5, 4), is_causal=True)
    with pytest.raises(ValueError, match="dim 4 is out of range"):
        sfd.shard_sequence(x, dim=4)
    with pytest.raises(ValueError, match="attn_mask"):
        sfd.RingSSAttention(2)(x, x, x, attn_mask=torch.ones(6, 6, dtype=torch.bool))


def test_not_initialised():
    assert not dist.is_initialized()
    x = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match="group: torch.distributed is not initialised"):
        sfd.ring_attention(x, x, x, score="ssa", score_params=(1.0, 1.5))
    with pytest.raises(ValueError, match="group: torch.distributed is not initialised"):
        sfd.shard_sequence(x)


@needs_gloo
@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_equals_unsharded(single_rank_group, causal):
    """A ring of one rank (no communication) is the unsharded attention of the public functions
    (Triton kernels where they run, else the reference), b and n given as numbers."""
    import ssa_flash

    backend = "triton" if (torch.cuda.is_available() or INTERPRETER) else "reference"
    g = torch.Generator().manual_seed(3)
    dtype = torch.float64 if DEVICE == "cpu" else torch.float32
    tol = TOL if dtype == torch.float64 else LOW_TOL[dtype]
    q, k, v = (torch.randn(1, 2, 8, 8, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()
               for _ in range(3))
    out = sfd.ring_attention(q, k, v, is_causal=causal, score="ssa", score_params=(0.8, 1.7),
                             adaptive_temperature=True, backend=backend)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = ssa_flash.ssa_attention(q, k, v, is_causal=causal, b=0.8, n=1.7, adaptive_temperature=True,
                                  backend=backend)
    grads_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    _close("out", out, ref, tol)
    for name, ours, theirs in zip("qkv", grads, grads_ref):
        _close(f"d{name}", ours, theirs, tol)
    with torch.no_grad():
        _close("out (no grad)", sfd.ring_attention(q, k, v, is_causal=causal, score="ssa", score_params=(0.8, 1.7),
                                                   backend=backend),
               ssa_flash.ssa_attention(q, k, v, is_causal=causal, b=0.8, n=1.7, backend=backend), tol)
    assert sfd.shard_positions(8, is_causal=causal).tolist() == list(range(8))  # one rank: no communication
