"""ssa_flash.bench.ledger: the GPU ledger's hash, merge, pending order, file shape, and the pytest
plugin that runs only what the ledger does not hold as passed."""
import json
import os
import subprocess
import sys
import textwrap

from ssa_flash.bench import ledger

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_kernel_hash_follows_the_kernel_sources(tmp_path):
    (tmp_path / "csrc" / "emu").mkdir(parents=True)
    (tmp_path / "ssa_flash" / "triton").mkdir(parents=True)
    (tmp_path / "csrc" / "a.cu").write_text("kernel")
    (tmp_path / "csrc" / "emu" / "b.h").write_text("header")
    (tmp_path / "ssa_flash" / "triton" / "k.py").write_text("x = 1")
    (tmp_path / "csrc" / "notes.md").write_text("not a source")
    h = ledger.kernel_hash(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in ledger.kernel_files(tmp_path)] == [
        "csrc/a.cu", "csrc/emu/b.h", "ssa_flash/triton/k.py"]
    (tmp_path / "csrc" / "notes.md").write_text("changed")
    assert ledger.kernel_hash(tmp_path) == h
    (tmp_path / "csrc" / "emu" / "b.h").write_text("header 2")
    assert ledger.kernel_hash(tmp_path) != h
    assert len(ledger.kernel_hash()) == 64


def test_merge_pending_and_file_shape(tmp_path):
    led = ledger.empty()
    ledger.merge(led, {"t::a": {"outcome": "passed", "duration_s": 1.23456}, "t::b": {"outcome": "failed"},
                       "t::c": {"outcome": "skipped"}, "t::x": {"outcome": "weird"}},
                 commit="abc", kernel_hash="H1", device="NVIDIA H200", date="2026-11-27")
    ledger.merge(led, {"t::d": {"outcome": "error", "duration_s": 2}, "t::e": {"outcome": "passed"}},
                 commit="def", kernel_hash="H2", device="NVIDIA H100", date="2026-11-28")
    assert led["kernel_hash"] == "H2" and "t::x" not in led["tests"]
    assert led["tests"]["t::a"] == {"outcome": "passed", "commit": "abc", "kernel_hash": "H1",
                                    "device": "NVIDIA H200", "date": "2026-11-27", "duration_s": 1.235}
    ids = ["t::a", "t::b", "t::c", "t::d", "t::e", "t::new"]
    # at H2: failures first (b, d), never run (new), then stale (a, c at H1); e passed at H2: done
    assert ledger.pending(led, ids, "H2") == ["t::b", "t::d", "t::new", "t::a", "t::c"]
    assert ledger.pending(led, ids, "H1") == ["t::b", "t::d", "t::new", "t::e"]
    assert ledger.summary(led, "H2") == {"passed": 1, "failed": 0, "error": 1, "skipped": 0, "stale": 3}
    path = tmp_path / "gpu-ledger.json"
    ledger.save(led, path)
    data = json.loads(path.read_text())
    assert list(data) == ["schema", "kernel_hash", "tests"] and data["schema"] == 1
    assert data == ledger.load(path) == led
    assert ledger.load(tmp_path / "none.json") == ledger.empty()


SAMPLE = textwrap.dedent("""
    def test_passed_before():
        pass

    def test_failed_before():
        pass

    def test_never_run():
        pass

    def test_passed_at_old_kernels():
        pass
""")


def test_plugin_runs_what_is_pending_first(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    led = ledger.empty()
    ledger.merge(led, {"test_sample.py::test_passed_before": {"outcome": "passed"},
                       "test_sample.py::test_failed_before": {"outcome": "failed"}},
                 commit="c", kernel_hash="NOW", device="d")
    ledger.merge(led, {"test_sample.py::test_passed_at_old_kernels": {"outcome": "passed"}},
                 commit="c", kernel_hash="OLD", device="d")
    led["kernel_hash"] = "NOW"
    ledger.save(led, tmp_path / "ledger.json")
    env = dict(os.environ, SSA_FLASH_LEDGER=str(tmp_path / "ledger.json"), SSA_FLASH_KERNEL_HASH="NOW",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "ssa_flash.bench.ledger", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), "test_sample.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    ran = [line.split("::")[1].split()[0] for line in run.stdout.splitlines() if "PASSED" in line]
    assert ran == ["test_failed_before", "test_never_run", "test_passed_at_old_kernels"]
    assert "1 deselected" in run.stdout
