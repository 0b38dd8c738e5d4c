"""Smoke tests of the reproduction examples (examples/icl_linear.py, examples/max_retrieval.py).

Each example runs in a subprocess with ``--smoke`` (a few dozen steps, tiny model) on the CPU with
the reference backend (``TRITON_INTERPRET`` removed from the environment, since the interpreter
would take minutes), then its JSON is checked for the expected fields and finite numbers.
``--quick`` (the documented CI smoke mode, < 2 minutes each) runs when SSA_FLASH_TEST_QUICK=1.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODE = "--quick" if os.environ.get("SSA_FLASH_TEST_QUICK", "0") not in ("", "0") else "--smoke"


def run_example(name, out_dir, *extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.join(ROOT, "examples", f"{name}.py"), MODE, "--device", "cpu",
           "--out", str(out_dir), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(os.path.join(out_dir, f"{name}.json")) as f:
        return json.load(f), proc.stdout


def tables(json_path):
    """examples/make_tables.py renders the JSON as the markdown tables of docs/reproduction.md."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "make_tables.py"), str(json_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_provenance(res, steps):
    prov = res["provenance"]
    for key in ("device", "torch", "date", "commit", "steps", "seeds", "backend", "argv"):
        assert key in prov, key
    assert prov["steps"] == steps
    assert prov["backend"] == "reference"
    assert set(prov["seeds"]) == {"init", "train_data", "eval"}
    assert prov["commit"] is None or len(prov["commit"]) == 40


def test_icl_linear(tmp_path):
    res, stdout = run_example("icl_linear", tmp_path, "--seed", "3")
    assert res["experiment"] == "icl_linear"
    check_provenance(res, res["config"]["steps"])
    assert res["provenance"]["seeds"] == {"init": 3, "train_data": 4, "eval": 5}
    for kind in ("softmax", "ssa"):
        assert res["train"][kind]["curve"] and all(finite(p["loss"]) for p in res["train"][kind]["curve"])
        ev = res["eval"][kind]
        assert sorted(ev, key=int) == [str(s) for s in range(1, 11)]
        for row in ev.values():
            for key in ("mse", "mse_sem", "mse_median", "zero_predictor_mse"):
                assert finite(row[key]) and row[key] >= 0, (kind, key, row[key])
            assert len(row["mse_by_k"]) == 40 and all(finite(x) for x in row["mse_by_k"])
    # both models saw the same test functions: same "predict 0" error
    for s in range(1, 11):
        assert res["eval"]["softmax"][str(s)]["zero_predictor_mse"] == res["eval"]["ssa"][str(s)]["zero_predictor_mse"]
    layers, heads = res["config"]["layers"], res["config"]["heads"]
    b, n = res["ssa_params"]["b"], res["ssa_params"]["n"]
    assert len(b) == layers and all(len(row) == heads for row in b)
    assert all(x > 0 for row in b for x in row) and all(x >= 1 for row in n for x in row)
    assert "sigma" in stdout and "softmax" in stdout
    assert "| 5 |" in tables(tmp_path / "icl_linear.json")


def test_max_retrieval(tmp_path):
    res, stdout = run_example("max_retrieval", tmp_path)
    assert res["experiment"] == "max_retrieval"
    check_provenance(res, res["config"]["steps"])
    sizes = res["test_sizes"]
    assert sizes[0] == 16 and all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    for s in sizes:
        row = res["eval"][str(s)]
        assert set(row) == {"softmax", "adaptive", "ssa", "ssa_adaptive"}
        for variant, r in row.items():
            assert finite(r["accuracy"]) and 0 <= r["accuracy"] <= 1
            assert finite(r["weight_on_max"]) and 0 <= r["weight_on_max"] <= 1 + 1e-5, (s, variant, r)
            assert finite(r["entropy_before_temperature"])
            if variant.endswith("adaptive"):
                assert finite(r["beta"]) and r["beta"] >= 1
    assert res["ssa_params"]["b"] > 0 and res["ssa_params"]["n"] >= 1
    assert "accuracy" in stdout
    assert "| 16 |" in tables(tmp_path / "max_retrieval.json")


def test_smoke_modes_write_outside_the_checkout():
    """``--quick`` / ``--smoke`` without ``--out`` leave the source tree clean (a temporary
    folder); the real runs default to ``examples/results/<example>-<mode>`` (committed results)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import run_info
    finally:
        sys.path.pop(0)
    root = os.path.realpath(ROOT) + os.sep
    for example in ("icl_linear", "max_retrieval"):
        for mode in ("quick", "smoke"):
            assert not os.path.realpath(run_info.default_out_dir(example, mode)).startswith(root)
        for mode in ("full", "cpu"):
            assert run_info.default_out_dir(example, mode) == os.path.join(ROOT, "examples", "results",
                                                                           f"{example}-{mode}")
