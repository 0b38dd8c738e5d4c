"""docs/support.md's tables hold: every cell is checked against what the code accepts.

Each table follows an HTML comment ``<!-- support-matrix: NAME -->``. A cell "yes" / "no" is
compared with the backend's ``supports(q, k, v, spec)`` (and ``unavailable_reason`` for the
device), a head-dim cell "≤ N" with the largest head dim ``supports`` takes, and the remaining
cells with the public functions' validation. The CUDA backend's hardware limits are probed
without a GPU: ``supports`` only reads shapes, dtypes and the device of its inputs, so it gets
stand-ins with a CUDA device, and the architecture's ``(major, minor, opt-in shared memory)`` is
the table's row (``_capability`` patched).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from attn_testing import fake

import ssa_flash
from ssa_flash import scores
from ssa_flash.backends import cuda_backend
from ssa_flash.backends import get
from ssa_flash.backends import triton_backend
from ssa_flash.spec import AttentionSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "support.md"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}
BACKENDS = ("triton", "cuda", "reference")


def table(name: str, text: str = None) -> Tuple[List[str], List[List[str]]]:
    """``(header, rows)`` of the table after ``<!-- support-matrix: name -->``, cells stripped of
    backticks and spaces."""
    lines = (DOC.read_text(encoding="utf-8") if text is None else text).splitlines()
    marker = f"<!-- support-matrix: {name} -->"
    assert marker in lines, f"docs/support.md has no {marker}"
    i = lines.index(marker) + 1
    while not lines[i].strip():
        i += 1
    rows = []
    while i < len(lines) and lines[i].lstrip().startswith("|"):
        rows.append([c.strip().replace("`", "") for c in lines[i].strip().strip("|").split("|")])
        i += 1
    assert len(rows) >= 3 and set(rows[1][0]) <= set("-: "), f"table {name} is malformed"
    return rows[0], rows[2:]


def yes_no(cell: str) -> bool:
    m = re.match(r"(yes|no)(?![a-z])", cell.lower())  # a footnote mark may follow
    assert m, f"cell {cell!r} is neither yes nor no"
    return m.group(1) == "yes"


def head_dim_bound(cell: str):
    """``"≤ 256"`` -> 256, ``"any"`` -> None; ``"–"``: no head dim at all -> 0."""
    if cell in ("–", "-"):
        return 0
    if cell == "any":
        return None
    m = re.fullmatch(r"(?:≤|<=)\s*(\d+)", cell)
    assert m, f"head dim cell {cell!r}: expected '≤ N', 'any' or '–'"
    return int(m.group(1))


def arch_of(cell: str) -> Tuple[int, int]:
    m = re.match(r"sm_(\d+)(\d)\b", cell)
    assert m, cell
    return int(m.group(1)), int(m.group(2))


def smem_of(cell: str) -> int:
    m = re.fullmatch(r"(\d+) KiB", cell)
    assert m, cell
    return int(m.group(1)) * 1024


@pytest.fixture
def on_arch(monkeypatch):
    """``on_arch(major, minor, optin)``: the CUDA backend sees that GPU."""
    def set_arch(major, minor, optin):
        monkeypatch.setattr(cuda_backend, "_capability", lambda device: (major, minor, optin))
        monkeypatch.setattr(cuda_backend, "_image_reason", lambda device: None)  # built for it
    return set_arch


# --------------------------------------------------------------------------------------------
# Features


def _case(feature: str, dtype=torch.float16, device="cuda", d=64):
    """``(q, k, v, spec)`` exercising ``feature`` (a row of the features table)."""
    B, H, L = 2, 4, 64
    q = k = v = fake((B, H, L, d), dtype, device)
    kw = {}
    if feature.startswith("adaptive temperature ("):
        kw = dict(adaptive=True)
    elif feature.startswith("causal"):
        kw = dict(causal=True)
    elif feature.startswith("grouped-query"):
        k = v = fake((B, H // 2, L, d), dtype, device)
        kw = dict(group=2)
    elif feature.startswith("dropout"):
        kw = dict(dropout_p=0.1, dropout_rng=torch.tensor([1, 2]))
    elif feature.startswith("local window"):
        kw = dict(window_left=8, window_right=0)
    elif feature == "deterministic=True":
        kw = dict(deterministic=True)
    elif feature.startswith("packed"):
        q = k = v = fake((B * L, H, d), dtype, device)
        cu = torch.tensor([0, L, 2 * L], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=L, max_seqlen_k=L)
    elif feature.startswith("KV-cache"):
        kw = dict(seqused_k=torch.full((B,), L, dtype=torch.int32))
    elif feature.startswith("logit soft-capping"):
        kw = dict(softcap=30.0)
    return q, k, v, AttentionSpec(scale=d ** -0.5, **kw)


def _sinks(feature: str, heads: int = 4):
    """The ``sinks`` argument of ``supports`` for a features-table row: a per-head tensor for the
    sinks row (the backends' interface: ``(Hq,)`` in the accumulation dtype), else None."""
    return torch.zeros(heads) if feature.startswith("attention sinks") else None


def _mask_refused(name: str) -> bool:
    """Whether the public functions refuse a mask that requires grad on backend ``name`` (their
    rule once the backend is chosen, ``ops._check_mask_grad``: no device needed)."""
    mask = torch.zeros(4, 4, requires_grad=True)
    try:
        ssa_flash.ops._check_mask_grad(mask, name)
    except ValueError as err:
        if "attn_mask" in str(err):
            return True
        raise
    return False


def _mask_kind_ok(name: str, dtype) -> bool:
    """The CUDA glue passes bool masks as bool (the kernels' boolean kind) and floating masks as
    float32 (their additive kind: the mask's dtype is its kind); the other backends take either as
    it is."""
    if name != "cuda":
        return True
    mask = cuda_backend._prep_mask(torch.zeros(2, 3, dtype=dtype))
    return mask.dtype == (torch.bool if dtype == torch.bool else torch.float32)


def accepts(name: str, feature: str, device="cuda") -> bool:
    """Whether backend ``name`` takes ``feature`` (a features-table row) on ``device``."""
    mod = get(name)
    if feature == "gradient with respect to attn_mask":
        return not _mask_refused(name)
    if feature.startswith("adaptive temperature over key shards"):
        return all(callable(getattr(mod, f, None)) for f in ("row_dbeta", "backward_given_g"))
    q, k, v, spec = _case(feature, device=device)
    if feature.startswith("score functions"):  # every function of the registry
        return all(mod.supports(q, k, v, dataclasses.replace(spec, score=f)) is None for f in scores.SCORES)
    ok = mod.supports(q, k, v, spec, _sinks(feature)) is None
    if feature.startswith("boolean mask"):
        ok = ok and _mask_kind_ok(name, torch.bool)
    elif feature.startswith("float mask"):
        ok = ok and _mask_kind_ok(name, torch.float16)
    return ok


FEATURES = (
    "score functions: softmax, SSA, logit scale (attention(score=...), softmax_attention, ssa_attention)",
    "adaptive temperature (adaptive_temperature_attention, adaptive_temperature=True)",
    "boolean mask (attn_mask, True = attend)",
    "float mask (added to the logits)",
    "causal (is_causal)",
    "grouped-query attention (enable_gqa)",
    "dropout (dropout_p)",
    "local window (window_size)",
    "deterministic=True",
    "packed variable-length batches (varlen_attention)",
    "KV-cache decoding (attention_with_kvcache)",
    "adaptive temperature over key shards (ring attention, ssa_flash.distributed)",
    "attention sinks (sinks)",
    "logit soft-capping (softcap)",
    "gradient with respect to attn_mask",
)


def test_features_table_has_the_checked_rows():
    header, rows = table("features")
    assert header == ["feature", *BACKENDS]
    assert [r[0] for r in rows] == list(FEATURES), "a row without a check here, or a check without a row"


@pytest.mark.parametrize("feature", FEATURES)
def test_features_table(feature, on_arch):
    header, rows = table("features")
    row = dict(zip(header, next(r for r in rows if r[0] == feature)))
    on_arch(8, 0, 166912)
    for name in BACKENDS:
        assert accepts(name, feature) == yes_no(row[name]), (
            f"docs/support.md says {name} {'does' if yes_no(row[name]) else 'does not'} support "
            f"{feature!r}; the code disagrees")


def test_cuda_features_do_not_depend_on_the_architecture(on_arch):
    """The features table has one CUDA column: its answers must hold on every architecture of the
    architectures table that takes float16."""
    _, rows = table("cuda-archs")
    answers = set()
    for r in rows:
        if not r[0].startswith("sm_"):
            continue
        on_arch(*arch_of(r[0]), smem_of(r[1]))
        answers.add(tuple(accepts("cuda", f) for f in FEATURES))
    assert len(answers) == 1


# --------------------------------------------------------------------------------------------
# dtypes, head dims, devices


def _largest_head_dim(mod, dtype, device, adaptive: bool, limit: int = 1024):
    """The largest head dim ``d`` such that ``mod.supports`` takes every head dim 1..d (None if
    it takes all up to ``limit``), checked for the fixed and adaptive temperature."""
    spec = AttentionSpec(scale=1.0, adaptive=adaptive)
    for d in range(1, limit + 1):
        x = fake((1, 2, 16, d), dtype, device)
        if mod.supports(x, x, x, spec) is not None:
            return d - 1
    return None


def _check_device_row(name: str, row: Dict[str, str], device: str):
    mod = get(name)
    # the CUDA extension's presence is a build matter, not a support one: only the device counts
    probe = cuda_backend._device_reason if name == "cuda" else mod.unavailable_reason
    available = probe(torch.device(device)) is None
    any_dtype = False
    for col, dtype in DTYPES.items():
        x = fake((1, 2, 16, 64), dtype, device)
        ok = available and mod.supports(x, x, x, AttentionSpec(scale=0.125)) is None
        ok_adaptive = available and mod.supports(x, x, x, AttentionSpec(scale=0.125, adaptive=True)) is None
        assert ok == ok_adaptive == yes_no(row[col]), (name, device, col)
        if ok:
            any_dtype = True
            bound = head_dim_bound(row["head dims"])
            for adaptive in (False, True):
                assert _largest_head_dim(mod, dtype, device, adaptive) == bound, (name, device, col, adaptive)
    if not any_dtype:
        assert head_dim_bound(row["head dims"]) == 0, "no dtype runs: the head dims cell must be '–'"


def test_cuda_archs_table(on_arch):
    header, rows = table("cuda-archs")
    assert header == ["architecture", "opt-in shared memory per block", *DTYPES, "head dims",
                      "verified on hardware"]
    archs = [r[0].split()[0] for r in rows]
    for arch in ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "CPU"):
        assert arch in archs, f"the CUDA table has no {arch} row"
    for r in rows:
        row = dict(zip(header, r))
        if r[0] == "CPU":
            _check_device_row("cuda", row, "cpu")
            continue
        major, minor = arch_of(r[0])
        on_arch(major, minor, smem_of(row["opt-in shared memory per block"]))
        _check_device_row("cuda", row, "cuda")
        assert yes_no(row["verified on hardware"]) == ((major, minor) in cuda_backend.VERIFIED_ARCHS)


def test_cuda_head_dim_bound_is_shared_memory(on_arch):
    """The '≤ 128' of sm_75 comes from its 64 KiB: with more opt-in shared memory the same
    architecture takes 256, i.e. the table's shared-memory column is what the test varies."""
    on_arch(7, 5, 65536)
    assert _largest_head_dim(cuda_backend, torch.float16, "cuda", False) == 128
    on_arch(7, 5, 200 * 1024)
    assert _largest_head_dim(cuda_backend, torch.float16, "cuda", False) == 256


TRITON_ROWS = {
    "CUDA GPU": ("cuda", None),
    "CPU, TRITON_INTERPRET=1 set before Triton is imported": ("cpu", True),
    "CPU otherwise": ("cpu", False),
}


_HAS_CUDA = torch.cuda.is_available()


def test_triton_devices_table(monkeypatch):
    header, rows = table("triton-devices")
    assert header == ["device", *DTYPES, "head dims"]
    assert [r[0] for r in rows] == list(TRITON_ROWS)
    for r in rows:
        device, interpret = TRITON_ROWS[r[0]]
        if interpret is not None:
            monkeypatch.setattr(triton_backend, "interpreting", lambda v=interpret: v)
        # the GPU row describes a machine with CUDA: without one, unavailable_reason says so
        monkeypatch.setattr(torch.cuda, "is_available", lambda v=device == "cuda": v or _HAS_CUDA)
        _check_device_row("triton", dict(zip(header, r)), device)


def test_reference_devices_table():
    header, rows = table("reference-devices")
    assert header == ["device", *DTYPES, "head dims"]
    assert [r[0] for r in rows] == ["any (CPU, CUDA)"]
    for device in ("cpu", "cuda"):
        _check_device_row("reference", dict(zip(header, rows[0])), device)


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.float8_e4m3fn])
def test_other_dtypes_are_refused(dtype):
    x = torch.zeros(1, 1, 4, 8).to(dtype)
    with pytest.raises(TypeError, match="query"):
        ssa_flash.ssa_attention(x, x, x)


# --------------------------------------------------------------------------------------------
# The parser


def test_table_parser():
    text = ("x\n<!-- support-matrix: t -->\n\n| a | `b` |\n|---|---|\n| 1 | yes¹ |\n| 2 | no |\n\nafter\n")
    assert table("t", text) == (["a", "b"], [["1", "yes¹"], ["2", "no"]])
    assert yes_no("yes¹") and not yes_no("no (see below)")
    with pytest.raises(AssertionError):
        yes_no("maybe")
    assert head_dim_bound("≤ 128") == 128 and head_dim_bound("any") is None and head_dim_bound("–") == 0
    assert arch_of("sm_120 (RTX 50xx)") == (12, 0) and arch_of("sm_75") == (7, 5)
