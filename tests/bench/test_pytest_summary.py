"""ssa_flash.bench.pytest_summary: the counts, failures and skip reasons of a pytest run, written as
it goes (bench/run_gpu.sh reads them after a time limit may have stopped the run)."""
import json
import os
import subprocess
import sys
import textwrap

SAMPLE = textwrap.dedent("""
    import pytest

    def test_ok():
        pass

    def test_wrong():
        assert 1 + 1 == 3, "arithmetic is off"

    def test_skipped():
        pytest.skip("no widget here")

    @pytest.fixture
    def broken():
        raise RuntimeError("fixture broke")

    def test_setup_error(broken):
        pass
""")


def test_counts_failures_and_skip_reasons(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    out = tmp_path / "counts.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, SSA_FLASH_TESTS_JSON=str(out),
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ssa_flash.bench.pytest_summary", "-p",
                    "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), run.stdout + run.stderr
    data = json.loads(out.read_text())
    assert (data["passed"], data["failed"], data["skipped"], data["errors"]) == (1, 2, 1, 1)
    assert data["incomplete"] is False and data["exitstatus"] == 1
    failures = {f["test"].split("::")[-1]: f for f in data["failures"]}
    assert set(failures) == {"test_wrong", "test_setup_error"}
    assert failures["test_wrong"]["when"] == "call" and "arithmetic is off" in failures["test_wrong"]["error"]
    assert failures["test_setup_error"]["when"] == "setup" and "fixture broke" in failures["test_setup_error"]["error"]
    assert data["skip_reasons"] == {"Skipped: no widget here": 1}
    tests = {k.split("::")[-1]: v for k, v in data["tests"].items()}
    assert {k: v["outcome"] for k, v in tests.items()} == {
        "test_ok": "passed", "test_wrong": "failed", "test_skipped": "skipped", "test_setup_error": "error"}
    assert all(v["duration_s"] >= 0 for v in tests.values())


GUARDED = textwrap.dedent("""
    import pytest

    def test_backend_missing():
        pytest.skip("CUDA backend unavailable: ")

    def test_other_skip():
        pytest.skip("bfloat16 needs sm_80")

    def test_cuda_error():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def test_after():
        pass
""")


def test_guards_require_cuda_and_cuda_errors(tmp_path):
    """SSA_FLASH_REQUIRE_CUDA=1 turns "CUDA backend unavailable" skips (only those) into failures;
    without xdist a CUDA error stops the session (the context is unusable)."""
    (tmp_path / "test_guarded.py").write_text(GUARDED)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "counts.json"
    env = dict(os.environ, SSA_FLASH_TESTS_JSON=str(out), SSA_FLASH_REQUIRE_CUDA="1",
               SSA_FLASH_CUDA_ERRORS_END_WORKERS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.pop("PYTEST_XDIST_WORKER", None)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ssa_flash.bench.pytest_summary", "-p",
                    "no:cacheprovider", "--rootdir", str(tmp_path), "test_guarded.py"],
                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    tests = {k.split("::")[-1]: v["outcome"] for k, v in json.loads(out.read_text())["tests"].items()}
    assert tests == {"test_backend_missing": "failed", "test_other_skip": "skipped", "test_cuda_error": "failed"}, tests
