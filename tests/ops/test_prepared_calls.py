"""Prepared calls (spec.Backend.prepare, ssa_flash/triton/prepared.py): a planned call's second
and later runs go through the backend's prepared launches and compute what the full path computes,
bit for bit; a changed launcher switch or a parameter aligned otherwise is seen (the full path
runs, then the call is prepared again). Under the interpreter (``plans.UNDER_INTERPRETER``) the
launches replay through ``kernel[grid]``, so the numbers are checked on the CPU."""
import pytest
import torch

pytest.importorskip("triton")

import ssa_flash  # noqa: E402
from ssa_flash import ops  # noqa: E402
from ssa_flash.backends import triton_backend  # noqa: E402
from ssa_flash.triton import kernel_args, plans  # noqa: E402

from attn_testing import CUDA  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture
def planned(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(plans, "UNDER_INTERPRETER", True)
    plans.clear()
    ops._call_plans.clear()  # (plans of other tests' calls, prepared or not)
    yield
    plans.clear()
    ops._call_plans.clear()


def _step(q, k, v, b, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)] + [b.detach().requires_grad_()]  # (b as laid out)
    out, lse = ssa_flash.attention(*leaves[:3], score="ssa", score_params={"b": leaves[3], "n": 1.25},
                                   adaptive_temperature=True, is_causal=True, backend="triton", return_lse=True,
                                   **kw)
    (out.sum() + 0.5 * lse.sum()).backward()
    return type(out.grad_fn).__name__, [out, lse] + [t.grad for t in leaves]


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g).to(DEVICE) for _ in range(3))
    return q, k, v, (torch.rand(2, generator=g) + 0.5).to(DEVICE)


def test_a_prepared_call_computes_what_the_full_path_computes(planned, monkeypatch):
    q, k, v, b = _inputs()
    kinds = [_step(q, k, v, b)[0] for _ in range(2)]
    assert kinds == ["_EagerAttentionBackward", "_PreparedAttentionBackward"], kinds
    kind, prepared = _step(q, k, v, b)
    monkeypatch.setattr(triton_backend, "prepare", lambda *a: None)
    plans.clear()
    full = [_step(q, k, v, b) for _ in range(2)][-1]
    assert kind == "_PreparedAttentionBackward" and full[0] == "_EagerAttentionBackward"
    for a, r in zip(prepared, full[1]):
        torch.testing.assert_close(a, r, atol=0, rtol=0)


def test_a_changed_switch_or_alignment_takes_the_full_path(planned, monkeypatch):
    q, k, v, b = _inputs(1)
    assert [_step(q, k, v, b)[0] for _ in range(2)][-1] == "_PreparedAttentionBackward"
    monkeypatch.setattr(kernel_args, "FORCE_POLY_EXP2", 3)  # a switch the kernels' constexprs read
    assert [_step(q, k, v, b)[0] for _ in range(2)] == ["_EagerAttentionBackward", "_PreparedAttentionBackward"]
    # a parameter tensor 4 bytes off the 16-byte alignment its plans were made with
    odd = torch.empty(b.numel() + 1, dtype=b.dtype, device=DEVICE)[1:].copy_(b)
    assert odd.data_ptr() % 16 != b.data_ptr() % 16
    kind, got = _step(q, k, v, odd)
    assert kind == "_EagerAttentionBackward"
    for a, r in zip(got, _step(q, k, v, b)[1]):
        torch.testing.assert_close(a, r, atol=0, rtol=0)


def test_a_mismatch_draws_the_dropout_seed_once(planned, monkeypatch):
    """A planned dropout call that its prepared call does not hold (a switch changed) runs with the
    seed already drawn: the same weights and the same generator state after it as an unplanned call."""
    q, k, v, b = _inputs(2)

    def dropout_call():
        out = ssa_flash.attention(q, k, v, score="ssa", score_params={"b": b, "n": 1.25}, dropout_p=0.3,
                                  backend="triton")
        return out, torch.randn(4, generator=None, device=DEVICE)  # the generator's next draw

    for _ in range(2):
        dropout_call()  # planned, then prepared
    monkeypatch.setattr(kernel_args, "FORCE_POLY_EXP2", 3)
    torch.manual_seed(7)
    got, after = dropout_call()  # the prepared call declines: the backend's full path
    ops._call_plans.clear()
    torch.manual_seed(7)
    want, want_after = dropout_call()  # unplanned
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(after, want_after, atol=0, rtol=0)
