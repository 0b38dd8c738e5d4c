"""The benchmark harness cannot rot: its CPU smoke mode runs end to end (Triton interpreter), and
the pieces (FLOP count, ratio table, time budget, out-of-memory rows) are checked on their own."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from ssa_flash.bench import impls, report, runner, timing  # noqa: E402

TOP_FIELDS = {"device", "date", "torch", "triton", "cuda", "matmul_tflops", "gpu_tests", "rows"}
ROW_FIELDS = {"op", "impl", "pass", "dtype", "batch", "heads", "seqlen", "headdim", "causal", "ms",
              "tflops", "peak_mem_bytes"}
CUDA = torch.cuda.is_available()
# The CPU smoke run is what CI checks; on a GPU machine test_gpu_bench_tiny covers the CUDA path.
cpu_only = pytest.mark.skipif(CUDA, reason="CPU harness test (interpreter); the GPU path is test_gpu_bench_tiny")
DESIGN_IMPLS = {"ssa_flash.triton", "ssa_flash.cuda", "ssa_flash.cuda_ws", "sdpa.flash", "sdpa.cudnn", "sdpa.efficient",
                "sdpa.math", "flex", "reference"}


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_INTERPRET"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # the smoke mode is the CPU path, even on a GPU machine
    return env


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    tests_json = out / "gpu_tests.json"
    tests_json.write_text(json.dumps({"passed": 3, "failed": 0, "skipped": 1}))
    proc = subprocess.run([sys.executable, "-m", "ssa_flash.bench", "--smoke", "--out", str(out),
                           "--gpu-tests-json", str(tests_json)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    return proc, out


@cpu_only
def test_smoke_runs_and_writes_results(smoke):
    proc, out = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.glob("*.json") if p.name != "gpu_tests.json")
    assert len(files) == 1 and re.fullmatch(r"\d{4}-\d{2}-\d{2}-cpu-smoke\.json", files[0]), files
    results = json.loads((out / files[0]).read_text())
    assert TOP_FIELDS <= set(results)
    assert results["gpu_tests"] == {"passed": 3, "failed": 0, "skipped": 1}
    assert results["matmul_tflops"] > 0
    assert "[" in proc.stderr and "ms" in proc.stderr  # progress lines
    assert "Ratios for ssa_flash.triton" in proc.stdout


@cpu_only
def test_smoke_rows_schema_and_values(smoke):
    proc, out = smoke
    path = next(p for p in out.glob("*-cpu-smoke.json"))
    rows = json.loads(path.read_text())["rows"]
    assert rows
    for r in rows:
        assert ROW_FIELDS <= set(r), r
        assert r["op"] in impls.OPS and r["impl"] in DESIGN_IMPLS and r["pass"] in impls.PASSES
        assert r["dtype"] == "float32" and isinstance(r["causal"], bool)
        assert all(isinstance(r[k], int) and r[k] > 0 for k in ("batch", "heads", "seqlen", "headdim"))
        if r["ms"] is None:
            assert r.get("note"), r
            continue
        assert math.isfinite(r["ms"]) and r["ms"] > 0
        assert math.isfinite(r["tflops"]) and r["tflops"] > 0
        fl = timing.attention_flops(r["batch"], r["heads"], r["seqlen"], r["seqlen"], r["headdim"],
                                    r["causal"], r["pass"])
        assert r["tflops"] == pytest.approx(fl / (r["ms"] * 1e-3) / 1e12, rel=1e-3)
    measured = {(r["op"], r["impl"], r["pass"]) for r in rows if r["ms"] is not None}
    for op in impls.OPS:
        for p in impls.PASSES:
            assert (op, "ssa_flash.triton", p) in measured, (op, p)  # the interpreter path ran
            assert (op, "reference", p) in measured, (op, p)
    assert ("softmax", "sdpa.math", "fwd") in measured
    mem = [r for r in rows if r.get("sweep") == "memory"]
    assert {r["seqlen"] for r in mem} == {16, 32} and all(r["pass"] == "fwd_bwd" for r in mem)


@cpu_only
def test_smoke_plots(smoke):
    proc, out = smoke
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plots skipped" in proc.stdout
        return
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert any("tflops-fwd_bwd" in n for n in pngs) and any("memory" in n for n in pngs), pngs
    for p in out.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@cpu_only
def test_from_json_rerenders(smoke, tmp_path):
    _, out = smoke
    path = next(p for p in out.glob("*-cpu-smoke.json"))
    proc = subprocess.run([sys.executable, "-m", "ssa_flash.bench", "--from-json", str(path), "--markdown",
                           "--no-plots"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| dtype | D | causal |" in proc.stdout


def test_flops_follow_design():
    assert timing.attention_flops(2, 3, 5, 7, 11, False, "fwd") == 4 * 2 * 3 * 5 * 7 * 11
    assert timing.attention_flops(2, 3, 5, 7, 11, True, "fwd") == 2 * 2 * 3 * 5 * 7 * 11
    assert timing.attention_flops(1, 1, 8, 8, 8, False, "bwd") == 2.5 * 4 * 8 ** 3
    assert timing.attention_flops(1, 1, 8, 8, 8, True, "fwd_bwd") == 3.5 * 2 * 8 ** 3
    assert timing.tflops(1e12, 1000.0) == pytest.approx(1.0)
    assert timing.tflops(1e12, None) is None


def _row(op, impl, pass_, ms, L=1024):
    return {"op": op, "impl": impl, "pass": pass_, "dtype": "bfloat16", "batch": 16, "heads": 16,
            "seqlen": L, "headdim": 64, "causal": False, "ms": ms, "tflops": None, "sweep": "speed"}


def test_ratio_table_values_and_marks():
    rows = [_row("ssa", "ssa_flash.triton", "fwd", 2.0), _row("softmax", "sdpa.flash", "fwd", 1.0),
            _row("ssa", "ssa_flash.triton", "fwd_bwd", 4.0), _row("softmax", "sdpa.flash", "fwd_bwd", 4.0),
            _row("softmax", "ssa_flash.triton", "fwd", 1.0), _row("adaptive", "ssa_flash.triton", "fwd", 1.5),
            _row("ssa", "flex", "fwd", None)]
    tables = report.ratio_tables({"rows": rows, "device": "X", "matmul_tflops": 100.0})
    (title, headers, body, notes), = tables
    line = dict(zip(headers, body[0]))
    assert line["SSA fwd vs sdpa.flash (>=1)"] == "0.50!"  # half the speed: misses the target
    assert line["SSA f+b vs sdpa.flash (>=0.9)"] == "1.00"
    assert line["adaptive/softmax fwd (<=1.4)"] == "1.50!"  # 1.5x our softmax: misses 1.4
    assert line["SSA fwd vs flex (>=1.5)"] == "-"  # flex has no time
    text = report.render_text(tables)
    assert "0.50!" in text


def test_cudnn_target_applies_from_4k():
    """SSA's forward against cuDNN's softmax is judged at L >= 4k only (docs/design.md §4.1)."""
    rows = []
    for L in (1024, 4096):
        rows += [_row("ssa", "ssa_flash.triton", "fwd", 2.0, L), _row("softmax", "sdpa.cudnn", "fwd", 1.0, L)]
    (title, headers, body, notes), = report.ratio_tables({"rows": rows, "device": "X"})
    col = headers.index("SSA fwd vs sdpa.cudnn (>=1 at L>=4k)")
    assert [line[col] for line in body] == ["0.50", "0.50!"]


def test_time_budget_and_oom_rows_are_recorded(monkeypatch):
    cfg = runner.Config(device="cpu", dtype=torch.float32, seqlens=(8,), headdims=(8,), batch_tokens=8,
                        heads=1, causal=(False,), ops=("softmax",), impls=("reference",),
                        memory_seqlens=(), matmul_size=16, quiet=True, time_budget_s=0.0)
    res = runner.Runner(cfg).run()
    assert res["rows"] and all(r["ms"] is None and "time budget" in r["note"] for r in res["rows"])

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")

    monkeypatch.setattr(runner, "build_call", oom)
    cfg.time_budget_s = None
    res = runner.Runner(cfg).run()
    assert len(res["rows"]) == 3
    assert all(r["ms"] is None and r["note"] == "out of memory" for r in res["rows"])


def test_memory_rows_that_would_overrun_the_budget_are_not_started(monkeypatch):
    """A memory-sweep row is expected to take the previous length's time times the squared length
    ratio: one that would end past the budget is skipped with that estimate, not started."""
    cfg = runner.Config(device="cpu", dtype=torch.float32, seqlens=(), headdims=(8,), batch_tokens=8, heads=1,
                        ops=("softmax",), impls=("reference",), memory_seqlens=(8, 16),
                        memory_impls=("reference",), memory_ops=("softmax",), matmul_size=16, quiet=True,
                        cpu_reps=1)
    r = runner.Runner(cfg)
    r.run()  # measures L = 8 and 16: the sweep remembers the last length's time
    seqlen, seconds = r._sweep_seconds[("softmax", "reference")]
    assert seqlen == 16 and seconds > 0

    def task(L):
        return runner.Task("memory", runner.Shape(1, 1, L, 8, True, torch.float32), "softmax", "reference",
                           ("fwd_bwd",))

    clock = [50.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: clock[0])
    r.start, r.cfg.time_budget_s = 0.0, 100.0
    r._sweep_seconds[("softmax", "reference")] = (16, 10.0)
    assert r.expected_seconds(task(32)) == 40.0 and r.would_overrun(task(32)) is None  # 50 + 40 <= 100
    assert r.would_overrun(task(64)) == 160.0  # 50 + 160 > 100
    (row,) = r.run_task(task(64), None)
    assert row["ms"] is None and row["note"].startswith("skipped: would overrun the time budget (~160 s")


def test_reference_rows_measure_on_cpu():
    cfg = runner.Config(device="cpu", dtype=torch.float32, seqlens=(8,), headdims=(8,), batch_tokens=8,
                        heads=1, causal=(True,), ops=("ssa",),
                        impls=("reference", "ssa_flash.cuda", "ssa_flash.cuda_ws"),
                        memory_seqlens=(), matmul_size=16, quiet=True, cpu_reps=1)
    res = runner.Runner(cfg).run()
    ref = [r for r in res["rows"] if r["impl"] == "reference"]
    assert len(ref) == 3 and all(r["ms"] > 0 and r["tflops"] > 0 for r in ref)
    cuda = [r for r in res["rows"] if r["impl"] == "ssa_flash.cuda"]
    assert len(cuda) == 3 and all(r["ms"] is None and r["note"] for r in cuda)
    ws = [r for r in res["rows"] if r["impl"] == "ssa_flash.cuda_ws"]  # (no CUDA here: a note, no figure)
    assert len(ws) == 3 and all(r["ms"] is None and r["note"] for r in ws)


def test_result_basename():
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-cpu", runner.result_basename(torch.device("cpu")))
    assert runner.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_bench_tiny(tmp_path):
    """The CUDA path end to end on small shapes: our kernels, SDPA, compiled FlexAttention SSA, the
    reference, peak memory and the memory sweep."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "ssa_flash.bench", "--out", str(tmp_path), "--seqlens", "256",
                           "--headdims", "64", "--batch-tokens", "512", "--heads", "4", "--causal", "true",
                           "--impls", "ssa_flash.triton,sdpa.flash,sdpa.math,flex,reference",
                           "--memory-max-seqlen", "2k", "--memory-impls", "ssa_flash.triton,reference",
                           "--memory-ops", "ssa", "--matmul-size", "2048", "--warmup-ms", "5", "--rep-ms", "10",
                           "--no-plots"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = next(p for p in tmp_path.glob("*.json"))
    res = json.loads(path.read_text())
    assert res["matmul_tflops"] > 1 and res["cuda"]
    rows = res["rows"]
    for r in rows:
        if r["impl"] in ("ssa_flash.triton", "sdpa.flash", "flex") and r["sweep"] == "speed":
            assert r["ms"] and r["ms"] > 0 and r["tflops"] > 0, r
            assert r["peak_mem_bytes"] and r["peak_mem_bytes"] > 0, r
    assert {r["op"] for r in rows if r["impl"] == "flex" and r["ms"]} == {"ssa"}
    mem = [r for r in rows if r["sweep"] == "memory" and r["impl"] == "ssa_flash.triton"]
    assert [r["seqlen"] for r in mem] == [1024, 2048]
    for r in mem:  # inputs, output and gradients are all alive at the peak of forward+backward
        assert r["ms"] and r["peak_mem_bytes"] >= 0.9 * r["io_bytes"], r


# --------------------------------------------------------------------------------------------
# Issue 24: what a first smoke run shows a user


def _mem_row(impl, L, ms, peak):
    return {"op": "ssa", "impl": impl, "pass": "fwd_bwd", "dtype": "float32", "batch": 1, "heads": 1,
            "seqlen": L, "headdim": 16, "causal": True, "ms": ms, "tflops": None,
            "peak_mem_bytes": peak, "io_bytes": 1000, "sweep": "memory"}


def test_memory_table_never_shows_times():
    """A CPU run measures no peak memory: its memory rows printed milliseconds under the
    "peak allocated memory (GiB)" caption."""
    rows = [_mem_row("reference", 16, 12.5, None), _mem_row("reference", 32, None, None),
            _mem_row("ssa_flash.triton", 16, 3.0, 2**30)]
    title, headers, body, notes = report.ratio_tables({"rows": rows, "device": "cpu x86_64"})[-1]
    assert title.startswith("Peak memory")
    cells = [c for line in body for c in line[1:]]
    assert not any("ms" in c for c in cells), body
    by = dict(zip(headers, body[0]))
    assert by["ssa reference"] == "n/a" and by["ssa ssa_flash.triton"].startswith("1.00G")
    assert dict(zip(headers, body[1]))["ssa reference"] == "-"
    assert any(n.startswith("n/a:") for n in notes)


def test_cpu_timings_are_not_judged_against_gpu_targets():
    """Interpreter timings were marked '!' against the GPU targets."""
    rows = [_row("ssa", "ssa_flash.triton", "fwd", 2.0), _row("softmax", "sdpa.flash", "fwd", 1.0)]
    for results in ({"rows": rows, "device": "cpu (Triton interpreter) x86_64", "smoke": True},
                    {"rows": rows, "device": "cpu x86_64"},  # an old file without the smoke key
                    {"rows": rows, "device": "NVIDIA H100", "smoke": True}):
        assert not report.comparable_with_targets(results)
        (title, headers, body, notes), = report.ratio_tables(results)
        assert "SSA fwd vs sdpa.flash" in headers and not any("(>=" in h or "(<=" in h for h in headers)
        assert body[0][headers.index("SSA fwd vs sdpa.flash")] == "0.50"
        assert "not comparable" in notes[0]
        assert "!" not in report.render_text([(title, headers, body, notes)]).replace("'!'", "")
    gpu = {"rows": rows, "device": "NVIDIA H100 80GB HBM3", "smoke": False}
    assert report.comparable_with_targets(gpu)
    (_, headers, body, _), = report.ratio_tables(gpu)
    assert body[0][headers.index("SSA fwd vs sdpa.flash (>=1)")] == "0.50!"


def test_smoke_result_name():
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-cpu-smoke", runner.result_basename(torch.device("cpu"), smoke=True))
    assert runner.result_basename("cpu", date="2024-01-02", smoke=True) == "2024-01-02-cpu-smoke"


@cpu_only
def test_smoke_default_output_is_found_and_named_smoke(tmp_path):
    """Without --out the smoke run left its JSON in a fresh temp directory; it now writes
    bench/results/<date>-cpu-smoke.json (under the current directory) and prints that path."""
    proc = subprocess.run([sys.executable, "-m", "ssa_flash.bench", "--smoke", "--seqlens", "16",
                           "--impls", "reference", "--ops", "ssa", "--passes", "fwd", "--causal", "true",
                           "--memory-max-seqlen", "0", "--matmul-size", "16", "--no-plots", "--quiet"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = list((tmp_path / "bench" / "results").glob("*.json"))
    assert len(files) == 1 and re.fullmatch(r"\d{4}-\d{2}-\d{2}-cpu-smoke\.json", files[0].name), files
    assert f"results: {files[0]}" in proc.stdout
    assert "not comparable" in proc.stdout
    assert json.loads(files[0].read_text())["smoke"] is True


def test_targets_subset_and_cudnn_baseline():
    """--subset targets: the rows docs/design.md's targets are judged on, cuDNN's SDPA beside the
    flash backend among the first rows measured."""
    from ssa_flash.bench import runner

    cfg = runner.apply_subset(runner.Config(device="cuda"), "targets")
    tasks = runner.plan(cfg)
    # softmax_learned_bias: the learned (H, L, S) bias's forward + backward beside SDPA's efficient backend
    assert {t.op for t in tasks} == {"softmax", "ssa", "adaptive", "softmax_learned_bias"}
    assert {t.impl for t in tasks if t.op == "softmax_learned_bias"} == {"ssa_flash.triton", "ssa_flash.cuda",
                                                                        "sdpa.efficient"}
    assert {t.impl for t in tasks if t.op != "softmax_learned_bias"} == {"ssa_flash.triton", "ssa_flash.cuda", "sdpa.flash",
                                                                         "sdpa.cudnn", "flex"}
    assert {t.shape.headdim for t in tasks if t.sweep == "speed"} == {64, 128}
    memory = [t for t in tasks if t.sweep == "memory"]
    assert {(t.shape.seqlen, t.op) for t in memory} == {(131072, "ssa")}
    first = tasks[:8]
    assert {"sdpa.flash", "sdpa.cudnn"} <= {t.impl for t in first}
    assert tasks[-1].impl == "flex"
    smoke = runner.Config(device="cpu", seqlens=(16,), impls=("ssa_flash.triton",), smoke=True)
    runner.apply_subset(smoke, "targets")
    assert smoke.seqlens == (16,) and smoke.impls == ("ssa_flash.triton",) and "ssa_adaptive" not in smoke.ops


def test_phases_choose_and_order_the_rows():
    """--phases: the memory row and FlexAttention's rows first (a time budget then cuts the speed
    rows instead), or a phase left out."""
    from ssa_flash.bench import runner

    cfg = runner.apply_subset(runner.Config(device="cuda"), "targets")
    cfg.phases = ("memory", "flex", "speed")
    tasks = runner.plan(cfg)
    assert [t.sweep for t in tasks[:2]] == ["memory", "memory"] and tasks[2].impl == "flex"
    assert {t.impl for t in tasks[2:] if t.impl != "flex"} >= {"ssa_flash.triton", "sdpa.flash"}
    cfg.phases = ("speed",)
    assert {t.sweep for t in runner.plan(cfg)} == {"speed"} and "flex" not in {t.impl for t in runner.plan(cfg)}
    from ssa_flash.bench.__main__ import build_parser

    assert build_parser().parse_args(["--phases", "memory,speed"]).phases == ["memory", "speed"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--phases", "memory,fast"])


def test_learned_bias_row():
    """The learned-bias row (forward + backward with a learned (H, L, L) bias): planned on a GPU for
    ssa_flash.triton and ssa_flash.cuda beside sdpa.efficient, never on the CPU; its call
    differentiates the bias."""
    from ssa_flash.bench import runner

    cfg = runner.Config(device="cuda", seqlens=(1024,), headdims=(64,), causal=(False,))
    rows = [(t.impl, t.passes) for t in runner.plan(cfg) if t.op == impls.LEARNED_BIAS_OP]
    assert rows == [("ssa_flash.triton", ("fwd_bwd",)), ("ssa_flash.cuda", ("fwd_bwd",)),
                    ("sdpa.efficient", ("fwd_bwd",))]
    cpu = runner.Config(device="cpu", seqlens=(16,), headdims=(16,), causal=(False,))
    assert not [t for t in runner.plan(cpu) if t.op == impls.LEARNED_BIAS_OP]
    if impls.availability("ssa_flash.triton", torch.device("cpu")) is None:  # the interpreter: run it
        shape = impls.Shape(1, 2, 16, 16, True, torch.float32)
        inputs = impls.make_inputs(shape, torch.device("cpu"))
        call = impls.build_call(impls.LEARNED_BIAS_OP, "ssa_flash.triton", shape, inputs, torch.device("cpu"))
        fn, cleanup = impls.pass_fn(call, "fwd_bwd", inputs.dout)
        grads = fn()
        cleanup()
        assert grads[-1].shape == (2, 16, 16) and grads[-1].abs().sum() > 0
