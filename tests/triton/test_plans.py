"""Launch plans (ssa_flash/triton/plans.py): a second call with the same shapes replays the first
call's launches with its own tensors. Under the interpreter (``plans.UNDER_INTERPRETER``) the
replay goes through ``kernel[grid]``, so what a plan fills in is checked numerically here; on a
GPU the same plans launch the kept compiled kernels (tests/ops run them there)."""
import pytest
import torch

pytest.importorskip("triton")

import ssa_flash  # noqa: E402
from ssa_flash.triton import block_choice, direct, kernel_args, plans  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def planned(monkeypatch):
    """Plans on (under the interpreter too), none kept from other tests."""
    if DEVICE == "cpu":
        monkeypatch.setattr(plans, "UNDER_INTERPRETER", True)
    plans.clear()
    yield
    plans.clear()


def _inputs(seed, B=2, Hq=4, Hkv=2, Lq=37, Lk=45, D=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g, dtype=dtype).to(DEVICE)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=dtype).to(DEVICE)
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=dtype).to(DEVICE)
    return q, k, v


CASES = {
    "softmax": dict(score="softmax"),
    "ssa_causal": dict(score="ssa", score_params={"b": 0.7, "n": 1.5}, is_causal=True),
    "ssa_tensor_params": dict(score="ssa", score_params=None),  # per-head tensors, set below
    "adaptive_bool_mask": dict(score="softmax", adaptive_temperature=True, attn_mask="bool"),
    "ssa_float_mask_window": dict(score="ssa", score_params={"b": 1.2, "n": 2.0}, attn_mask="float",
                                  window_size=(9, 3)),
    "logit_scale_softcap": dict(score="logit_scale", score_params={"s": 1.5}, softcap=4.0),
}


def _kwargs(case, seed, Hq=4, Lq=37, Lk=45):
    kw = dict(CASES[case])
    g = torch.Generator().manual_seed(1000 + seed)
    if kw.get("attn_mask") == "bool":
        m = torch.rand(Lq, Lk, generator=g) > 0.3
        m[:, 0] = True
        kw["attn_mask"] = m.to(DEVICE)
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(1, Hq, Lq, Lk, generator=g).to(DEVICE)
    if case == "ssa_tensor_params":
        kw["score_params"] = {"b": (torch.rand(Hq, generator=g) + 0.5).to(DEVICE),
                              "n": (torch.rand(Hq, generator=g) * 2).to(DEVICE)}
    return kw


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_replayed_forward_computes_with_its_own_tensors(planned, case):
    hits = plans.HITS[0]
    outs = []
    for seed in range(3):  # the first call plans, the next two replay with other values
        q, k, v = _inputs(seed)
        kw = _kwargs(case, seed)
        out = ssa_flash.attention(q, k, v, enable_gqa=True, backend="triton", **kw)
        ref = ssa_flash.attention(q, k, v, enable_gqa=True, backend="reference", **kw)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        outs.append(out)
    sites = 2 if CASES[case].get("adaptive_temperature") else 1  # the row entropy's launch too
    assert plans.HITS[0] - hits == 2 * sites, "the second and third calls should replay the first call's plans"
    assert not torch.equal(outs[1], outs[2])


def test_a_replayed_dropout_forward_draws_fresh_bits(planned):
    q, k, v = _inputs(0)
    torch.manual_seed(5)
    first = ssa_flash.attention(q, k, v, dropout_p=0.3, enable_gqa=True, backend="triton")
    hits = plans.HITS[0]
    torch.manual_seed(6)
    second = ssa_flash.attention(q, k, v, dropout_p=0.3, enable_gqa=True, backend="triton")
    assert plans.HITS[0] == hits + 1
    assert not torch.equal(first, second)
    torch.manual_seed(6)  # the replay's bits are the reference's for the same seed
    ref = ssa_flash.attention(q, k, v, dropout_p=0.3, enable_gqa=True, backend="reference")
    torch.testing.assert_close(second, ref, atol=2e-5, rtol=2e-5)


def test_other_shapes_strides_or_switches_make_other_plans(planned):
    q, k, v = _inputs(0)
    ssa_flash.attention(q, k, v, enable_gqa=True, backend="triton")
    hits = plans.HITS[0]
    variants = [
        _inputs(1, Lq=36),  # another length
        tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in _inputs(2)),  # other strides
    ]
    for q2, k2, v2 in variants:
        out = ssa_flash.attention(q2, k2, v2, enable_gqa=True, backend="triton")
        ref = ssa_flash.attention(q2, k2, v2, enable_gqa=True, backend="reference")
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    out = ssa_flash.attention(q, k, v, enable_gqa=True, is_causal=True, backend="triton")
    torch.testing.assert_close(out, ssa_flash.attention(q, k, v, enable_gqa=True, is_causal=True,
                                                        backend="reference"), atol=2e-5, rtol=2e-5)
    assert plans.HITS[0] == hits  # none of them replayed the first plan


def test_the_stub_exit_forgets_plans():
    """Plans made in stub mode launch nothing: they must not outlive it."""
    with direct.stub(90):
        plans.put(("a key",), plans.Plan([]))
        assert plans.get(("a key",)) is not None
    assert plans.get(("a key",)) is None


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_replayed_backward_computes_with_its_own_tensors(planned, case):
    hits = plans.HITS[0]
    grads = []
    for seed in range(3):  # the first call plans forward and backward, the next two replay both
        q, k, v = _inputs(seed)
        kw = _kwargs(case, seed)
        tensors = [q, k, v] + [p for p in (kw.get("score_params") or {}).values() if isinstance(p, torch.Tensor)]
        got = []
        for backend in ("triton", "reference"):
            leaves = [t.detach().clone().requires_grad_() for t in tensors]
            call_kw = dict(kw)
            if len(leaves) > 3:
                call_kw["score_params"] = dict(zip(kw["score_params"], leaves[3:]))
            out = ssa_flash.attention(*leaves[:3], enable_gqa=True, backend=backend, **call_kw)
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
            got.append(torch.autograd.grad(out, leaves, dout))
        for mine, ref in zip(*got):
            torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)
        grads.append(got[0])
    sites = 3 if CASES[case].get("adaptive_temperature") else 2  # (row entropy,) forward, backward
    assert plans.HITS[0] - hits == 2 * sites, "calls 2 and 3 should replay the forward's and the backward's plans"
    assert not torch.equal(grads[1][0], grads[2][0])


def test_a_warp_specialised_replay_installs_the_allocator(monkeypatch):
    """Triton's allocator (for the device-side tensor descriptors of the warp-specialised forward) is
    a context variable: a replay in another thread (a checkpointed forward recomputed by the
    autograd engine) must install it as the first launch did."""
    from ssa_flash.spec import AttentionSpec
    from ssa_flash.triton import block_choice, kernel_args, launch

    installed, launched = [], []
    monkeypatch.setattr(block_choice, "ensure_allocator", lambda: installed.append(1))

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **consts: launched.append(args)

    slots = tuple(kernel_args.PARAMS["fwd"].index(n) for n in launch.FWD_SLOTS)
    template = [None] * len(kernel_args.PARAMS["fwd"])
    q = torch.zeros(1, 2, 3, 4)
    for ws in (False, True):
        plan = plans.Plan([plans.Launch(None, (1,), template, slots, (Kernel(), {}))],
                          ((1, 2, 3, 4), (1, 2, 3), torch.float32, 0, None, ws))
        launch.fwd_replay(plan, q, q, q, None, (), None, AttentionSpec(scale=1.0))
    assert installed == [1] and len(launched) == 2 and launched[1][0] is q
