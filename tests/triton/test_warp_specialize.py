"""The forward kernel's warp-specialised form (``WARP_SPECIALIZE``: Q, K, V through device-side
tensor descriptors, one key loop over every block with the boundary logits, ``tl.range(...,
warp_specialize=True)``) and the launcher's choice of it.

Under the interpreter the kernel runs with the flag on (it supports ``tl.make_tensor_descriptor``;
``warp_specialize`` changes nothing there): the descriptor tiling and indexing, the single loop's
masking (causal diagonal, ragged ends) and every score function through ``SCORE``, against the
reference. The launcher offers the form only on sm_90 (the interpreter has no architecture), so
these tests put its configuration first with 16 x 16 tiles. Whether it is warp-specialised when
compiled for sm_90: tests/audit/test_audit.py (slow)."""
import pytest
import torch

from ssa_flash.triton import block_choice, launch, tiles, tuning_cache
from ssa_flash.spec import AttentionSpec

from attn_testing import DEVICE, INTERPRETER, call, check, head_params, make_qkv, needs_kernels
import ssa_flash
from ssa_flash import reference

WS_BLOCKS = tiles.Blocks(16, 16, 4, 1, True)


@pytest.fixture
def forced_ws(monkeypatch):
    """The launcher with the warp-specialised configuration first (fresh choice tables)."""
    if not INTERPRETER:
        pytest.skip("the interpreter's 16 x 16 configuration; on a GPU see SSA_FLASH_WARP_SPECIALIZE")
    monkeypatch.setattr(tiles, "warp_specialized_forward", lambda arch, hb, dtype: WS_BLOCKS)
    monkeypatch.setattr(block_choice, "triton_warp_specializes", lambda: True)
    monkeypatch.setenv(block_choice.WS_ENV, "1")
    monkeypatch.setattr(block_choice, "chosen_blocks", {})
    yield
    launch.direct.LAUNCHER.clear()


def _fwd_ws_taken():
    return [b for key, b in block_choice.chosen_blocks.items()
            if key[0] == "fwd" and isinstance(b, tiles.Blocks) and b.ws]


@pytest.mark.parametrize("mode,causal,lq,lk", [("softmax", False, 37, 45), ("ssa", True, 45, 37),
                                               ("adaptive", True, 36, 36), ("ssa_adaptive", False, 20, 50),
                                               ("ssa", False, 40, 128), ("adaptive", False, 36, 256)])
@needs_kernels
def test_ws_forward_matches_reference(forced_ws, mode, causal, lq, lk):
    q, k, v = make_qkv(B=1, Hq=2, Lq=lq, Lk=lk, D=64, dtype=torch.float16, requires_grad=False)
    b, n = head_params(2, device=q.device)
    b, n = b.detach(), n.detach()
    kw = dict(is_causal=causal, return_lse=True)
    out, lse = call(ssa_flash, mode, q, k, v, b, n, backend="triton", **kw)
    assert _fwd_ws_taken(), "the launcher did not run the warp-specialised forward"
    # non-causal with whole key blocks (Lk a multiple of 128): the loop without index checks
    full = [key for key in block_choice.chosen_blocks if key[0] == "fwd" and ("WS_FULL_BLOCKS", True) in key[5]]
    assert bool(full) == (not causal and lk % 128 == 0)
    gold_out, gold_lse = call(reference, mode, q.double(), k.double(), v.double(), b.double(), n.double(), **kw)
    naive_out, _ = call(reference, mode, q, k, v, b, n, **kw)
    err = (out.double() - gold_out).abs().max().item()
    naive_err = (naive_out.double() - gold_out).abs().max().item()
    assert err <= 2 * naive_err + 2e-3, (err, naive_err)
    finite = torch.isfinite(gold_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite].double(), gold_lse[finite], rtol=1e-4, atol=1e-4)


@needs_kernels
def test_ws_gqa(forced_ws):
    """Grouped heads: the K / V descriptors of key/value head ``h // group``."""
    q, k, v = make_qkv(B=2, Hq=4, Hkv=2, Lq=24, Lk=40, D=64, dtype=torch.float16, requires_grad=False)
    b, n = (t.detach() for t in head_params(4, device=q.device))
    kw = dict(is_causal=True, return_lse=True, enable_gqa=True)
    out, lse = call(ssa_flash, "ssa", q, k, v, b, n, backend="triton", **kw)
    assert _fwd_ws_taken()
    gold, gold_lse = call(reference, "ssa", q.double(), k.double(), v.double(), b.double(), n.double(), **kw)
    torch.testing.assert_close(out.double(), gold, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse.double(), gold_lse, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_ws_logit_scale_causal_ragged(forced_ws):
    """The logit scale (a negative one included) through the single masked loop."""
    q, k, v = make_qkv(B=2, Hq=2, Lq=33, Lk=47, D=128, dtype=torch.float16, requires_grad=False)
    s = torch.tensor([0.7, -1.3], dtype=torch.float32, device=q.device)
    spec = AttentionSpec(scale=64 ** -0.5, causal=True, score="logit_scale")
    out, lse = launch.forward(q, k, v, None, (s,), None, spec)
    assert _fwd_ws_taken()
    z = (q.double() @ k.double().transpose(-1, -2)) * 64 ** -0.5 * s.double()[:, None, None]
    i = torch.arange(33)[:, None]
    j = torch.arange(47)[None, :]
    z = z.masked_fill(~(j <= i), float("-inf"))
    gold_lse = torch.logsumexp(z, -1)
    gold = torch.softmax(z, -1) @ v.double()
    torch.testing.assert_close(out.double(), gold, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse.double(), gold_lse, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_ws_adaptive_needs_aligned_rows(forced_ws):
    """beta goes through a descriptor too: with Lq not a multiple of 4 its rows are not 16-byte
    aligned and the launcher keeps the pointer loads."""
    q, k, v = make_qkv(B=1, Hq=2, Lq=37, Lk=37, D=64, dtype=torch.float16, requires_grad=False)
    out, lse = call(ssa_flash, "adaptive", q, k, v, backend="triton", return_lse=True)
    assert not _fwd_ws_taken()
    gold, _ = call(reference, "adaptive", q.double(), k.double(), v.double(), return_lse=True)
    torch.testing.assert_close(out.double(), gold, rtol=2e-2, atol=2e-2)


@needs_kernels
def test_ws_same_as_pointer_loads(forced_ws, monkeypatch):
    """With the flag off (same 16 x 16 tiles) the kernel gives the same outputs up to the order
    of float32 rounding in the interior tiles (pointer loads, three loop stages)."""
    q, k, v = make_qkv(B=1, Hq=2, Lq=40, Lk=40, D=64, dtype=torch.float16, requires_grad=False)
    b, n = head_params(2, device=q.device)
    spec = AttentionSpec(scale=0.125, causal=True, score="ssa")
    params = (b.detach().float(), n.detach().float())
    out_ws, lse_ws = launch.forward(q, k, v, None, params, None, spec)
    assert _fwd_ws_taken()
    monkeypatch.setenv(block_choice.WS_ENV, "0")
    monkeypatch.setattr(block_choice, "chosen_blocks", {})
    out, lse = launch.forward(q, k, v, None, params, None, spec)
    assert not _fwd_ws_taken()
    torch.testing.assert_close(out_ws, out, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(lse_ws, lse, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the launcher's candidate list


def _cands(monkeypatch, knob=None, arch=90, ws_ok=True, hb=128, dtype=torch.bfloat16, name="fwd"):
    if knob is None:
        monkeypatch.delenv(block_choice.WS_ENV, raising=False)
    else:
        monkeypatch.setenv(block_choice.WS_ENV, knob)
    return block_choice.candidate_blocks(name, arch, hb, dtype, {"MASK_KIND": 0}, ws_ok)


def test_candidate_offered_second_on_sm90(monkeypatch):
    monkeypatch.setattr(block_choice, "triton_warp_specializes", lambda: True)
    for hb in (64, 128):
        cands = _cands(monkeypatch, hb=hb)
        ws = [c for c in cands if c.ws]
        assert len(ws) == 1 and cands.index(ws[0]) == 1, cands  # never first: deterministic=True takes the first
        assert ws[0].warps == 4 and ws[0].stages == 2
        assert _cands(monkeypatch, "1", hb=hb)[0] == ws[0]
        assert not any(c.ws for c in _cands(monkeypatch, "0", hb=hb))


@pytest.mark.parametrize("case", [dict(arch=80), dict(arch=100), dict(ws_ok=False), dict(hb=256), dict(hb=32),
                                  dict(dtype=torch.float32), dict(name="row_entropy"), dict(name="bwd_dq")])
def test_candidate_refused(monkeypatch, case):
    monkeypatch.setattr(block_choice, "triton_warp_specializes", lambda: True)
    assert not any(c.ws for c in _cands(monkeypatch, "1", **case))


def test_candidate_needs_triton_3_6(monkeypatch):
    monkeypatch.setattr(block_choice.triton, "__version__", "3.5.1")
    assert not block_choice.triton_warp_specializes()
    assert not any(c.ws for c in _cands(monkeypatch, "1"))
    monkeypatch.setattr(block_choice.triton, "__version__", "3.6.0")
    assert block_choice.triton_warp_specializes()
    assert _cands(monkeypatch, "1")[0].ws


def test_tma_ready():
    x = torch.empty(2, 4, 64, 128, dtype=torch.bfloat16)
    assert block_choice.tma_ready(x, x.transpose(1, 2))
    assert not block_choice.tma_ready(x[..., 1:])  # data pointer 2 bytes past an aligned one
    assert not block_choice.tma_ready(torch.empty(2, 4, 64, 132, dtype=torch.bfloat16)[..., :128])  # 264-byte rows
    assert not block_choice.tma_ready(x.transpose(-1, -2))  # column stride 64


def test_cache_round_trip(monkeypatch, tmp_path):
    """A tuned warp-specialised choice is filed with its flag and read back as itself."""
    monkeypatch.setenv(tuning_cache.CACHE_ENV, str(tmp_path))
    ws = tiles.Blocks(128, 64, 4, 2, True)
    plain = tiles.Blocks(128, 64, 4, 2)
    tuning_cache.cache_store("k", ws, [(plain, 1.0), (ws, 0.5)])
    assert tuning_cache.cache_load("k", [plain, ws]) == ws
    tuning_cache.cache_store("k", plain, [])
    assert tuning_cache.cache_load("k", [plain, ws]) == plain
