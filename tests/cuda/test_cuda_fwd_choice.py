"""The CUDA backend's choice between its forward kernels (ssa_flash/backends/cuda_fwd_choice.py):
the sm_90a warp-specialised forward only where a committed table row (measured on a GPU) says it
is fastest; forced on or off by the benchmark / device tests; left to the extension's own
environment variable when that is set. CPU only, with fake tables and a fake extension (< 1 s)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ssa_flash.backends import cuda_backend, cuda_fwd_choice
from ssa_flash.spec import AttentionSpec

ROOT = Path(__file__).resolve().parents[2]
ROW = dict(arch="sm_90a", dtype="bfloat16", head_dim=128, causal=False, len_min=4096, len_max=16384,
           scores=["ssa", "softmax"], adaptive=None, evidence="bench/results/fake.json")
H100 = (9, 0)


def _table(*rows):
    return cuda_fwd_choice.parse_table({"rows": list(rows)})


def test_committed_table_parses_and_cites_results():
    """The committed table is well formed and every row's evidence is a committed results file."""
    data = json.loads(cuda_fwd_choice.TABLE_PATH.read_text())
    for row in cuda_fwd_choice.parse_table(data):
        assert (ROOT / row.evidence.split("#")[0]).is_file(), row


def test_table_rows_match_only_their_shapes():
    t = _table(ROW)
    hit = dict(capability=H100, dtype="bfloat16", head_dim=128, causal=False, len_q=8192, len_k=8192, score="ssa",
               adaptive=False)
    assert cuda_fwd_choice.table_prefers_ws(t, **hit)
    for change in (dict(capability=(8, 0)), dict(dtype="float16"), dict(head_dim=64), dict(causal=True),
                   dict(len_q=1024), dict(len_k=32768), dict(score="logit_scale")):
        assert not cuda_fwd_choice.table_prefers_ws(t, **{**hit, **change}), change
    only_plain = _table({**ROW, "adaptive": False})
    assert not cuda_fwd_choice.table_prefers_ws(only_plain, **{**hit, "adaptive": True})
    assert not cuda_fwd_choice.table_prefers_ws((), **hit)


def test_malformed_rows_are_refused():
    with pytest.raises(ValueError, match="row 0"):
        _table({k: v for k, v in ROW.items() if k != "head_dim"})
    with pytest.raises(ValueError, match="evidence"):
        _table({**ROW, "evidence": ""})


def test_wanted_forced_then_env_then_table(monkeypatch):
    monkeypatch.delenv(cuda_fwd_choice.ENV, raising=False)
    args = (H100, "bfloat16", 128, False, 8192, 8192, "ssa", False)
    t = _table(ROW)
    assert cuda_fwd_choice.wanted(*args, table=t) is True
    assert cuda_fwd_choice.wanted(*(H100, "bfloat16", 128, False, 1024, 1024, "ssa", False), table=t) is False
    assert cuda_fwd_choice.wanted(*args, table=()) is None  # no row for the architecture: leave the switch
    assert cuda_fwd_choice.wanted(*((8, 0), *args[1:]), table=t) is None
    with cuda_fwd_choice.forced(False):
        assert cuda_fwd_choice.wanted(*args, table=t) is False
        with cuda_fwd_choice.forced(True):
            assert cuda_fwd_choice.wanted(*args, table=()) is True
        assert cuda_fwd_choice.wanted(*args, table=t) is False
    monkeypatch.setenv(cuda_fwd_choice.ENV, "0")  # the extension reads it: the table is not applied
    assert cuda_fwd_choice.wanted(*args, table=t) is None
    with cuda_fwd_choice.forced(True):
        assert cuda_fwd_choice.wanted(*args, table=t) is True


class _FakeExt:
    def __init__(self):
        self.calls = []

    def hopper_fwd(self, on=None):
        self.calls.append(on)
        return dict(built=True, enabled=bool(on))


def test_backend_sets_the_switch_from_the_table(monkeypatch):
    """cuda_backend's forward asks the table (a fake one) and sets the extension's switch per call;
    with the committed (empty) table it never touches it."""
    monkeypatch.delenv(cuda_fwd_choice.ENV, raising=False)
    q = torch.empty(1, 2, 8192, 128, dtype=torch.bfloat16)
    spec = AttentionSpec(scale=0.1, score="ssa")
    ext = _FakeExt()
    monkeypatch.setattr(cuda_fwd_choice, "TABLE", ())
    cuda_backend._choose_fwd_kernel(ext, q, q, spec, 128, 128)
    assert ext.calls == []
    monkeypatch.setattr(cuda_fwd_choice, "TABLE", _table(ROW))
    cuda_backend._choose_fwd_kernel(ext, q, q, spec, 128, 128)
    short = q[:, :, :1024]
    cuda_backend._choose_fwd_kernel(ext, short, short, spec, 128, 128)
    assert ext.calls == [True, False]
    with cuda_fwd_choice.forced(True):
        cuda_backend._choose_fwd_kernel(ext, short, short, spec, 128, 128)
    assert ext.calls == [True, False, True]


def test_may_apply(monkeypatch):
    monkeypatch.delenv(cuda_fwd_choice.ENV, raising=False)
    monkeypatch.setattr(cuda_fwd_choice, "TABLE", ())
    assert not cuda_fwd_choice.may_apply()
    with cuda_fwd_choice.forced(False):
        assert cuda_fwd_choice.may_apply()
    monkeypatch.setattr(cuda_fwd_choice, "TABLE", _table(ROW))
    assert cuda_fwd_choice.may_apply()
    monkeypatch.setenv(cuda_fwd_choice.ENV, "1")
    assert not cuda_fwd_choice.may_apply()


# ---- the backward's kernel: "fwd_bwd" rows (csrc/hopper/bwd_launch.h) ----
BWD_ROW = {**ROW, "pass": "fwd_bwd"}


def test_backward_rows_concern_the_backward_only(monkeypatch):
    """A "fwd_bwd" row chooses the sm_90a backward and not the forward; a forward row the
    forward and not the backward; rows without a pass are forward rows."""
    monkeypatch.delenv(cuda_fwd_choice.ENV, raising=False)
    monkeypatch.delenv(cuda_fwd_choice.ENV_BWD, raising=False)
    args = (H100, "bfloat16", 128, False, 8192, 8192, "ssa", False)
    bwd_only, fwd_only = _table(BWD_ROW), _table(ROW)
    assert fwd_only[0].pass_ == "fwd" and bwd_only[0].pass_ == "fwd_bwd"
    assert cuda_fwd_choice.wanted(*args, table=bwd_only, kernel="bwd") is True
    assert cuda_fwd_choice.wanted(*args, table=bwd_only, kernel="fwd") is None  # no forward row: leave it
    assert cuda_fwd_choice.wanted(*args, table=fwd_only, kernel="bwd") is None
    assert cuda_fwd_choice.wanted(*(H100, "bfloat16", 128, True, 8192, 8192, "ssa", False), table=bwd_only,
                                  kernel="bwd") is False
    with pytest.raises(ValueError, match="pass"):
        _table({**ROW, "pass": "bwd_fwd"})
    # forced: both kernels, or each as told; the environment variable of each kernel alone
    with cuda_fwd_choice.forced(True, backward=False):
        assert cuda_fwd_choice.wanted(*args, table=(), kernel="fwd") is True
        assert cuda_fwd_choice.wanted(*args, table=(), kernel="bwd") is False
    with cuda_fwd_choice.forced(False):
        assert cuda_fwd_choice.wanted(*args, table=bwd_only, kernel="bwd") is False
    monkeypatch.setenv(cuda_fwd_choice.ENV_BWD, "1")
    assert cuda_fwd_choice.wanted(*args, table=bwd_only, kernel="bwd") is None
    assert cuda_fwd_choice.env_setting("bwd") is True and cuda_fwd_choice.env_setting("fwd") is None
    monkeypatch.setattr(cuda_fwd_choice, "TABLE", bwd_only)
    assert not cuda_fwd_choice.may_apply("bwd")  # (the extension reads SSA_FLASH_HOPPER_BWD itself)
    monkeypatch.delenv(cuda_fwd_choice.ENV_BWD)
    assert cuda_fwd_choice.may_apply("bwd") and not cuda_fwd_choice.may_apply("fwd")


class _FakeExtBoth(_FakeExt):
    def __init__(self):
        super().__init__()
        self.bwd_calls = []

    def hopper_bwd(self, on=None):
        self.bwd_calls.append(on)
        return dict(built=True, enabled=bool(on))


def test_backend_sets_the_backward_switch_from_the_table(monkeypatch):
    monkeypatch.delenv(cuda_fwd_choice.ENV_BWD, raising=False)
    q = torch.empty(1, 2, 8192, 128, dtype=torch.bfloat16)
    spec = AttentionSpec(scale=0.1, score="ssa")
    ext = _FakeExtBoth()
    monkeypatch.setattr(cuda_fwd_choice, "TABLE", ())
    cuda_backend._choose_kernel(ext, "bwd", q, q, spec, 128, 128)
    assert ext.bwd_calls == [] and ext.calls == []
    monkeypatch.setattr(cuda_fwd_choice, "TABLE", _table(BWD_ROW))
    cuda_backend._choose_kernel(ext, "bwd", q, q, spec, 128, 128)
    short = q[:, :, :1024]
    cuda_backend._choose_kernel(ext, "bwd", short, short, spec, 128, 128)
    cuda_backend._choose_fwd_kernel(ext, q, q, spec, 128, 128)  # (no forward row)
    assert ext.bwd_calls == [True, False] and ext.calls == []


def test_forced_reaches_autograds_thread(monkeypatch):
    """A CUDA tensor's backward runs on autograd's device thread: forced() in the caller's thread
    must reach it (a thread-local choice alone would leave the backward's switch unforced)."""
    import threading

    monkeypatch.delenv(cuda_fwd_choice.ENV_BWD, raising=False)
    args = (H100, "bfloat16", 128, False, 8192, 8192, "ssa", False)
    seen = []
    worker = lambda: seen.append(cuda_fwd_choice.wanted(*args, table=(), kernel="bwd"))  # noqa: E731
    with cuda_fwd_choice.forced(False, backward=True):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [True, None]
