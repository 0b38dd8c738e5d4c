"""bench/run_gpu.sh, the one command of a GPU session: it parses, and the tests it re-runs first
(bench/gpu_recheck.txt) still exist under those names (a renamed test would silently drop out)."""
import os
import subprocess
import sys

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
