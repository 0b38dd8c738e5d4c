"""bench/run_gpu.sh, the one command of a GPU session: it parses, the tests it re-runs first
(bench/gpu_recheck.txt) still exist under those names (a renamed test would silently drop out), and
a rehearsal without a GPU (``DRY_RUN=1``: Triton's interpreter and the CUDA emulator stand in)
takes every step's plumbing end to end: the build step, the CUDA matrix collected and recorded,
the ledger written and used (tests passed in one step are not run again; failures first), a CUDA
error that ends an xdist worker while the others go on, a step cut at its time limit (what it
recorded kept, the run going on). No verdict depends on the machine's speed: the limits are hang
catchers, and the one cut the rehearsal checks is made by the hanging test itself."""
import json
import os
import subprocess
import sys
import textwrap

from ssa_flash.bench import ledger

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_script_parses():
    subprocess.run(["bash", "-n", os.path.join(ROOT, "bench", "run_gpu.sh")], check=True)


def test_recheck_ids_are_collected():
    with open(os.path.join(ROOT, "bench", "gpu_recheck.txt")) as fh:
        ids = [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]
    if not ids:
        return
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"{len(ids)} test" in run.stdout.splitlines()[-1], run.stdout[-2000:]


SAMPLE = textwrap.dedent("""
    def test_a():
        pass

    def test_b():
        pass

    def test_c():
        pass

    def test_cuda_error():
        raise RuntimeError("CUDA error: device-side assert triggered")

    def test_d():
        pass

    def test_e():
        pass

    def test_f():
        pass
""")

# The controller of each pytest step marks every test whose reports it has taken in (after the
# ledger's plugin, ssa_flash.bench.pytest_summary, has recorded it: trylast).
CONFTEST = textwrap.dedent("""
    import os
    import pytest

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(report):
        if report.when == "teardown" and not os.environ.get("PYTEST_XDIST_WORKER"):
            open(os.path.join({recorded!r}, report.nodeid.split("::")[-1]), "w").close()
""")

# A test that hangs, in the step after the one it hung in last time (the recheck). Once the test
# beside it is recorded it sends SIGALRM to its step's timeout(1): that is the signal timeout's own
# timer delivers, so the step ends exactly as at its limit (TERM to the step's processes, exit 124)
# whatever the time the step took so far: the verdict does not depend on the machine's speed.
HANG = textwrap.dedent("""
    import os
    import signal
    import time

    def _step_timeout_pid():
        pid = os.getpid()
        for _ in range(20):  # worker -> pytest controller -> timeout
            with open(f"/proc/{{pid}}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
            if pid <= 1:
                break
            with open(f"/proc/{{pid}}/comm") as f:
                if f.read().strip() == "timeout":
                    return pid
        raise AssertionError("this step does not run under timeout(1)")

    def test_hangs():
        deadline = time.monotonic() + 300  # only against a hang of the rehearsal itself
        while not os.path.exists(os.path.join({recorded!r}, "test_c")) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(_step_timeout_pid(), signal.SIGALRM)
        time.sleep(600)
""")


def test_dry_run_rehearsal(tmp_path):
    """Every step's plumbing, with no verdict that depends on the machine's speed: the time limits
    are hang catchers (many minutes), and the one limit that must fire is made to fire by the
    hanging test itself (HANG) once what it checks has been recorded."""
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    (tmp_path / "conftest.py").write_text(CONFTEST.format(recorded=str(recorded)))
    sample = tmp_path / "test_sample.py"
    sample.write_text(SAMPLE)
    hang = tmp_path / "test_hang.py"
    hang.write_text(HANG.format(recorded=str(recorded)))
    (tmp_path / "recheck.txt").write_text(f"# what failed or hung last time\n{sample}::test_c\n{hang}::test_hangs\n")
    out = tmp_path / "out"
    limit = 900  # each step's: a hang catcher only
    budget = 8 * limit  # cap() never shortens a step's limit
    env = dict(os.environ, DRY_RUN="1", OUT=str(out), PYTHON=sys.executable, JOBS="2",
               SSA_FLASH_CUDA_ERRORS_END_WORKERS="1", CUDA_OBJECTS=str(tmp_path / "no-objects"),
               SMOKE_TRITON_ARGS=f"{sample} -k test_a",
               MATRIX_ARGS="tests/cuda/test_cuda_matrix.py -k 'bf16 and d256'",  # collected, skipped here
               HOPPER_ARGS="tests/cuda/test_hopper_fwd_device.py",  # the sm_90a forward's matrix: skipped here
               HOPPER_BWD_ARGS="tests/cuda/test_hopper_bwd_device.py",  # the sm_90a backward's: skipped here
               SMOKE_ARGS=f"{sample} -k 'test_b'", SELFCHECK_ARGS="--help",
               RECHECK=str(tmp_path / "recheck.txt"), SUITE=str(sample),
               **{f"{step}_LIMIT": str(limit) for step in ("BUILD", "HOPPER", "HOPPER_BWD", "SMOKE", "MATRIX",
                                                           "SELFCHECK", "DIAG", "RECHECK", "SUITE")})
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("SSA_FLASH_TESTS_JSON", None)
    run = subprocess.run(["bash", os.path.join(ROOT, "bench", "run_gpu.sh"), str(budget)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=budget + 120)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "dry run: nothing built" in (out / "build.log").read_text()
    for name in ("smoke-triton", "hopper-fwd", "hopper-bwd", "cuda-matrix", "smoke-cuda", "recheck", "suite"):
        assert (out / f"{name}-tests.json").exists() and (out / f"{name}.log").exists(), name
        assert f"{name}: pytest" in log and f"(limit {limit}s)" in log.split(f"{name}: pytest", 1)[1].split("\n")[0]
    assert "usage: python -m ssa_flash" in (out / "selfcheck.log").read_text()

    # the CUDA matrix: collected and recorded (on the CPU these rows skip: GPU only)
    matrix = json.loads((out / "cuda-matrix-tests.json").read_text())["tests"]  # d256 bf16: 7 x 2 + 1 entropy
    assert len(matrix) == 15 and all(v["outcome"] == "skipped" for v in matrix.values()), matrix

    # the sm_90a warp-specialised forward's matrix (the dry run's architecture is sm_90a): run before
    # the CUDA matrix, collected and recorded (GPU only: skipped here), in the ledger
    assert log.index("hopper-fwd: pytest") < log.index("cuda-matrix: pytest")
    hopper = json.loads((out / "hopper-fwd-tests.json").read_text())["tests"]
    assert len(hopper) == 13 and all(v["outcome"] == "skipped" for v in hopper.values()), hopper
    # then the sm_90a backward's (the dispatch beside today's backward, the switch, the routing)
    assert log.index("hopper-fwd: pytest") < log.index("hopper-bwd: pytest") < log.index("cuda-matrix: pytest")
    hopper_bwd = json.loads((out / "hopper-bwd-tests.json").read_text())["tests"]
    assert len(hopper_bwd) == 10 and all(v["outcome"] == "skipped" for v in hopper_bwd.values()), hopper_bwd

    # the recheck: the hanging test ended its step at the step's time limit; the test beside it,
    # recorded before the limit, is kept; the run went on
    assert "recheck rc 124 (time limit)" in log, log[-3000:]
    recheck = json.loads((out / "recheck-tests.json").read_text())
    assert recheck["incomplete"] is True and {k.split("::")[-1] for k in recheck["tests"]} == {"test_c"}, recheck

    # the ledger: every step's outcomes, at this run's kernel hash, device and commit
    led = ledger.load(out / "gpu-ledger.json")
    tests = {k.split("::")[-1]: v for k, v in led["tests"].items()}
    assert led["kernel_hash"] == tests["test_a"]["kernel_hash"] and len(led["kernel_hash"]) == 64
    assert {tests[t]["outcome"] for t in ("test_a", "test_b", "test_c", "test_d", "test_e", "test_f")} == {"passed"}
    assert tests["test_cuda_error"]["outcome"] == "failed"
    assert "test_hangs" not in tests  # stopped by its step's limit: never run, first next time
    assert tests["test_a"]["device"] == "cpu (dry run)" and tests["test_a"]["commit"] != "unknown"

    # the suite ran only what the ledger did not hold as passed (a, b, c passed in earlier steps)
    suite_log = (out / "suite.log").read_text()
    suite = json.loads((out / "suite-tests.json").read_text())
    assert {k.split("::")[-1] for k in suite["tests"]} == {"test_cuda_error", "test_d", "test_e", "test_f"}, suite
    # the CUDA error ended its worker, xdist replaced it: d, e, f still passed
    assert "CUDA error in" in suite_log or "crashed" in suite_log, suite_log[-3000:]
    assert suite["incomplete"] is False, suite
    gpu_tests = json.loads((out / "gpu-tests.json").read_text())
    assert set(gpu_tests["steps"]) >= {"hopper-fwd", "cuda-matrix", "recheck", "suite"} and gpu_tests["steps"]["recheck"]["incomplete"]


def test_cuda_objects_plumbing(tmp_path):
    """The objects compiled off the GPU: nvcc's flags are the extension's, one object per unit for
    the one architecture, and a manifest that must match csrc/ and the GPU before they are used."""
    from ssa_flash.backends import _cuda_build as cb
    from ssa_flash.backends import cuda_backend

    assert cb.NVCC_FLAGS == cuda_backend.NVCC_FLAGS
    csrc = os.path.join(ROOT, "csrc")
    assert sorted(cb.CU_UNITS) == sorted(os.path.basename(p) for p in os.listdir(csrc) if p.endswith(".cu"))
    cmds = cb.object_commands(csrc, tmp_path, "90a", nvcc="nvcc")
    assert len(cmds) == len(cb.CU_UNITS)
    assert all("arch=compute_90a,code=sm_90a" in c and "-fPIC" in c and c[-1].endswith(".o") for c in cmds)
    assert "no readable manifest.json" in cb.objects_reason(csrc, tmp_path, "90a")
    manifest = {"arch": "90a", "csrc_hash": cb.csrc_hash(csrc), "objects": {}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert "objects missing" in cb.objects_reason(csrc, tmp_path, "90a")
    for unit in cb.CU_UNITS:
        (tmp_path / (unit[:-3] + ".o")).write_bytes(b"")
    assert cb.objects_reason(csrc, tmp_path, "90a") is None
    assert "this GPU needs sm_80" in cb.objects_reason(csrc, tmp_path, "80")
    (tmp_path / "manifest.json").write_text(json.dumps(dict(manifest, csrc_hash="old")))
    assert "kernels changed" in cb.objects_reason(csrc, tmp_path, "90a")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "ssa_flash", "backends", "_cuda_build.py"), "build",
                          "--dry", "--out", str(tmp_path), "--arch", "90a"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "not used: the objects were compiled from other csrc/" in run.stdout, run.stdout


def test_compile_objects_writes_a_manifest(tmp_path):
    """`_cuda_build.py objects` (here with a stand-in nvcc that writes its -o file): one object per
    unit, a manifest that objects_reason accepts."""
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Cuda compilation tools, release 13.0'; exit 0; fi\n"
                    "while [ $# -gt 0 ]; do if [ \"$1\" = -o ]; then printf 0123456789 > \"$2\"; fi; shift; done\n")
    fake.chmod(0o755)
    out = tmp_path / "objs"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "ssa_flash", "backends", "_cuda_build.py"), "objects",
                          "--out", str(out), "--arch", "90a", "--nvcc", str(fake)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["arch"] == "90a" and manifest["nvcc"].endswith("release 13.0") and manifest["std"] == "c++20"
    assert sorted(manifest["objects"]) == sorted(u[:-3] + ".o" for u in ("fwd_fp16.cu", "fwd_bf16.cu", "bwd_fp16.cu",
                                                                         "bwd_bf16.cu"))
    assert set(manifest["objects"].values()) == {10}
    from ssa_flash.backends import _cuda_build as cb
    assert cb.objects_reason(os.path.join(ROOT, "csrc"), out, "90a") is None


def test_hopper_fwd_build_flag(tmp_path, monkeypatch):
    """The sm_90a forward is compiled into sm_90a builds when SSA_FLASH_BUILD_HOPPER_FWD=1 (as
    run_gpu.sh exports), never into others; objects built the other way are refused."""
    from ssa_flash.backends import _cuda_build as cb

    monkeypatch.setenv(cb.HOPPER_FWD_ENV, "1")
    assert cb.hopper_fwd_flags("90a") == ["-DSSA_FLASH_HOPPER_FWD=1"] == cb.hopper_fwd_flags("8.0;9.0a")
    assert cb.hopper_fwd_flags("80") == [] == cb.hopper_fwd_flags("8.0;9.0")
    csrc = os.path.join(ROOT, "csrc")
    assert all("-DSSA_FLASH_HOPPER_FWD=1" in c for c in cb.object_commands(csrc, tmp_path, "90a"))
    manifest = {"arch": "90a", "hopper_flags": [], "csrc_hash": cb.csrc_hash(csrc), "objects": {}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    for unit in cb.CU_UNITS:
        (tmp_path / (unit[:-3] + ".o")).write_bytes(b"")
    assert "this build wants ['-DSSA_FLASH_HOPPER_FWD=1']" in cb.objects_reason(csrc, tmp_path, "90a")
    monkeypatch.setenv(cb.HOPPER_SWEEP_ENV, "1")
    assert cb.hopper_fwd_flags("90a") == ["-DSSA_FLASH_HOPPER_FWD=1", "-DSSA_FLASH_HOPPER_MUFU_SWEEP=1"]
    monkeypatch.setenv(cb.HOPPER_FWD_ENV, "0")
    assert cb.hopper_fwd_flags("90a") == [] and cb.objects_reason(csrc, tmp_path, "90a") is None
    assert "SSA_FLASH_BUILD_HOPPER_FWD=${SSA_FLASH_BUILD_HOPPER_FWD:-1}" in open(
        os.path.join(ROOT, "bench", "run_gpu.sh")).read()
