"""The sm_90a backward's shipped instances (tests/cuda/hopper_bwd.cu: fp16 / bf16, D 64 / 128,
softmax / SSA, fixed / adaptive temperature) compiled for sm_90a with nvcc, their SASS read
(tools/hopper_bwd_model.py, which also gives the static bound model of the main loop):

* every instance has the TMA loads (UTMALDG, 2-D statistics and 4-D tiles) and the descriptor prefetch, the
  mbarrier operations (SYNCS), wgmma (HGMMA, with the both-transposed dQ GEMM and the
  N-major-B dK GEMM), the roles' register budgets (USETMAXREG 24 / 240), the consumers'
  named barrier and dQ's red.global.add (RED);
* no spills (ptxas -v: no spill stores or loads, no stack frame) in any of the 16;
* bench/results/hopper-bwd-model.json holds the model's current figures.

Skipped without nvcc / cuobjdump. Compiling the 16 instances takes ~2 minutes (slow).
"""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

import background

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "bench" / "results" / "hopper-bwd-model.json"
INSTANCES = [(dt, d, sc, ad) for dt in ("bf16", "fp16") for d in (64, 128) for sc in ("softmax", "ssa")
             for ad in (False, True)]


def _model():
    """tools/hopper_bwd_model.py."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import hopper_bwd_model
    finally:
        sys.path.pop(0)
    return hopper_bwd_model


def _build():
    """{(dtype, D, score, adaptive): (row, kernel SASS)} or None without the tools."""
    m = _model()
    if shutil.which("nvcc") is None:
        return None
    try:
        from ssa_flash.audit.compile import tool

        if tool("cuobjdump") is None:
            return None
    except (ImportError, FileNotFoundError):
        return None
    sc = m._sass_count()
    log, sass = m.build(background.tmpdir("hopper_bwd_sm90a"))
    res = sc.ptxas_resources(log)
    kernels = sc.split_kernels(sass)
    names = sc.demangle(list(kernels))
    out = {}
    for mangled, text in kernels.items():
        inst = m.instance_name(names[mangled])
        if inst is not None:
            row = dict(res.get(mangled, {}))
            row.update(m.model_loop(text, inst[1]))
            out[inst] = (row, text)
    return out


def prebuild(items):
    if any("hopper_sass" in item.fixturenames for item in items):
        background.submit("hopper_bwd.sm90a", _build)


@pytest.fixture(scope="module")
def hopper_sass():
    built = background.submit("hopper_bwd.sm90a", _build).result()
    if built is None:
        pytest.skip("nvcc or cuobjdump not found")
    return built


@pytest.mark.parametrize("inst", INSTANCES, ids=lambda i: f"{i[0]}-D{i[1]}-{i[2]}{'-adaptive' if i[3] else ''}")
def test_hopper_bwd_sass(hopper_sass, inst):
    row, sass = hopper_sass[inst]
    ops = set(re.findall(r"\b([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_x]+)*)\b", sass))
    for prefix in ("UTMALDG.2D", "UTMALDG.4D", "UTMACCTL.PF", "SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK", "HGMMA.64x",
                   "BAR.SYNC", "RED", "ELECT"):
        assert any(o.startswith(prefix) for o in ops), f"no {prefix} in the SASS"
    assert re.search(r"HGMMA\.64x64x16\.F32\S* \S+, gdesc\[\w+\]\.tnspA\.tnspB", sass), "no dQ = dS K wgmma"
    assert re.search(r"gdesc\[\w+\]\.tnspB", sass), "no dK wgmma with an N-major B"
    assert re.search(r"USETMAXREG\.DEALLOC\S* 0x18\b", sass) and re.search(r"USETMAXREG\.TRY_ALLOC\S* \w+, 0xf0\b", sass)
    # 5 GEMMs per score: 5 D multiply-adds per element in the step loop
    assert row["tensor_macs_per_element"] == 5 * inst[1]


@pytest.mark.parametrize("inst", INSTANCES, ids=lambda i: f"{i[0]}-D{i[1]}-{i[2]}{'-adaptive' if i[3] else ''}")
def test_hopper_bwd_no_spills(hopper_sass, inst):
    row, _ = hopper_sass[inst]
    assert row["spill_stores"] == 0 and row["spill_loads"] == 0 and row["stack"] == 0, row
    assert row["local_in_loop"] == 0, row


def test_hopper_bwd_model_figures_current(hopper_sass):
    """The committed figures are what the model gives for today's kernel (rerun
    python tools/hopper_bwd_model.py --json bench/results/hopper-bwd-model.json after a change)."""
    committed = {(r["dtype"], r["D"], r["score"], r["adaptive"]): r for r in json.loads(FIGURES.read_text())["rows"]}
    for inst, (row, _) in hopper_sass.items():
        for key in ("per_element", "mufu_per_element", "bound", "bound_tflops", "serial_tflops", "spill_stores"):
            assert committed[inst][key] == row[key], f"{inst} {key}: committed {committed[inst][key]}, now {row[key]}"
