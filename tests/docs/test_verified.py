"""docs/verified.md, the one page saying what has been run on which hardware, is what
``python -m ssa_flash.bench.verified`` generates from the committed records (bench/results/: the
GPU sessions' results and logs, the GPU test ledger, the audit); the other documents link to it
instead of restating it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from ssa_flash.bench import verified

ROOT = Path(__file__).resolve().parents[2]


def test_page_is_what_the_committed_records_give():
    page = ROOT / "docs" / "verified.md"
    assert page.is_file(), "docs/verified.md is missing: run python -m ssa_flash.bench.verified"
    assert page.read_text() == verified.render(ROOT), (
        "docs/verified.md differs from what bench/results/ gives: run python -m ssa_flash.bench.verified")


def test_check_mode(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    assert verified.main(["--root", str(tmp_path), "--check"]) == 1
    assert verified.main(["--root", str(tmp_path)]) == 0
    assert verified.main(["--root", str(tmp_path), "--check"]) == 0


def _records(tmp_path) -> Path:
    """A checkout holding the committed results (without any ledger)."""
    dest = tmp_path / "bench" / "results"
    shutil.copytree(ROOT / "bench" / "results", dest, ignore=shutil.ignore_patterns("*.png", "*.log"))
    (dest / "gpu-ledger.json").unlink(missing_ok=True)
    return tmp_path


def test_without_a_ledger_no_test_is_called_verified_on_a_gpu(tmp_path):
    text = verified.render(_records(tmp_path))
    assert "No per-test GPU record exists yet" in text
    assert "## GPU sessions" in text and "## Static audit" in text


def test_a_cpu_smoke_result_is_no_gpu_session(tmp_path):
    root = _records(tmp_path)
    smoke = {"device": "cpu", "date": "2026-12-02", "smoke": True, "rows": [{"impl": "ssa_flash.triton"}]}
    (root / "bench" / "results" / "2026-12-02-cpu-smoke.json").write_text(json.dumps(smoke))
    assert "2026-12-02" not in verified.render(root)


def test_a_second_session_of_the_day_comes_after_the_first(tmp_path):
    """A later session of the same day and GPU is committed under the first one's name extended
    (``<date>-<gpu>-session4.json``, its logs ``<date>-<gpu>-session4-logs/``, its host file
    ``<date>-<gpu>-session4-host.json``): listed after the first, each with its own logs."""
    res = tmp_path / "bench" / "results"
    res.mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    for base, passed, commit in (("2026-12-03-nvidia-h200", 11, "aaaaaaa0"),
                                 ("2026-12-03-nvidia-h200-session4", 22, "bbbbbbb0")):
        doc = {"device": "NVIDIA H200", "date": "2026-12-03", "git_commit": commit,
               "rows": [{"impl": "ssa_flash.triton", "dtype": "bfloat16", "headdim": 64}]}
        (res / f"{base}.json").write_text(json.dumps(doc))
        host = {"device": "NVIDIA H200", "date": "2026-12-03", "rows": [
            {"impl": base, "op": "softmax", "feature": "plain", "pass": "fwd", "host_us": 1.0}]}
        (res / f"{base}-host.json").write_text(json.dumps(host))
        (res / f"{base}-logs").mkdir()
        (res / f"{base}-logs" / "call1-suite-tests.json").write_text(json.dumps({"passed": passed}))
    assert [s["path"].name for s in verified.sessions(tmp_path)] == [
        "2026-12-03-nvidia-h200.json", "2026-12-03-nvidia-h200-session4.json"]
    text = verified.render(tmp_path)
    assert text.index("`aaaaaaa`") < text.index("`bbbbbbb`")  # the commits, in table order
    steps = [line for line in text.splitlines() if line.startswith("| `call1-suite-tests.json` |")]
    assert steps == ["| `call1-suite-tests.json` | 11 passed, 0 failed, 0 skipped |",
                     "| `call1-suite-tests.json` | 22 passed, 0 failed, 0 skipped |"]
    assert text.index("| 2026-12-03-nvidia-h200 | softmax |") < text.index("| 2026-12-03-nvidia-h200-session4 | softmax |")


def test_with_a_ledger(tmp_path):
    root = _records(tmp_path)
    rec = {"commit": "0123456789abcdef", "device": "NVIDIA H200", "date": "2026-12-01", "duration_s": 1.0}
    ledger = {"schema": 1, "kernel_hash": "new", "tests": {
        "tests/triton/test_dropout.py::test_a[ssa]": {**rec, "outcome": "passed", "kernel_hash": "new"},
        "tests/triton/test_dropout.py::test_b": {**rec, "outcome": "passed", "kernel_hash": "old"},
        "tests/cuda/test_cuda_backend.py::test_c": {**rec, "outcome": "failed", "kernel_hash": "new"},
        "tests/ops/test_kvcache.py::test_d": {**rec, "outcome": "skipped", "kernel_hash": "new"},
    }}
    (root / "bench" / "results" / "gpu-ledger.json").write_text(json.dumps(ledger))
    text = verified.render(root)
    assert "No per-test GPU record" not in text
    assert "| `triton` | 2 | 0 | 0 | 0 | 1 |" in text  # two passes, one of them stale
    assert "| `cuda` | 0 | 1 | 0 | 0 | 0 |" in text
    assert "| `tests/triton/test_dropout.py` | triton | dropout | 2 | 0 | 0 | 0 | 1 | NVIDIA H200 | 2026-12-01 | `0123456` |" in text
    assert "* `tests/cuda/test_cuda_backend.py::test_c`: failed on NVIDIA H200, 2026-12-01, commit `0123456`" in text


def test_backend_of_a_test_id():
    assert verified.backend_of("tests/cuda/test_cuda_features.py::test_x[a]") == "cuda"
    assert verified.backend_of("tests/triton/test_window.py::test_y") == "triton"
    assert verified.backend_of("tests/reference/test_reference.py::test_z") == "reference"
    assert verified.backend_of("tests/ops/test_varlen.py::test_w") == "other"


# documents that used to restate what ran where; each now links to docs/verified.md
LINKING = ["README.md", "docs/support.md", "docs/reliability.md", "docs/benchmarks.md", "docs/cuda.md",
           "docs/distributed.md", "docs/api.md"]
# claims that contradicted the records (or each other) before the page existed
STALE = ["No GPU run has been made", "bfloat16 results on the interpreter are not to be trusted",
         "kernels do not implement them yet", "Two short H200 sessions have run"]


def test_other_documents_link_here_and_do_not_contradict_it():
    for name in LINKING:
        text = (ROOT / name).read_text()
        assert "verified.md" in text, f"{name} does not link to docs/verified.md"
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = " ".join(path.read_text().split())
        for claim in STALE:
            assert claim not in text, f"{path.name}: {claim!r}"
