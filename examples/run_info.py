"""What a results file of the examples records about the run that made it (provenance), shared by
icl_linear.py and max_retrieval.py. Imported by them as a sibling module (the examples run as
scripts, so their directory is on ``sys.path``)."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import tempfile

import torch

import ssa_flash

HERE = os.path.dirname(os.path.abspath(__file__))


#: modes whose results are kept in the repository (examples/results/<example>-<mode>/); the smoke
#: modes (--quick, --smoke) write outside the source tree unless --out says otherwise
KEPT_MODES_DIR = os.path.join(HERE, "results")


def default_out_dir(example: str, mode: str) -> str:
    """Where ``example`` writes a ``mode`` run without ``--out``: ``examples/results/<example>-<mode>``
    for the real runs (full, presets: results worth committing), a folder under the system's
    temporary directory for the smoke modes (``quick``, ``smoke``), so that trying an example
    leaves the checkout clean."""
    if mode in ("quick", "smoke"):
        return os.path.join(tempfile.gettempdir(), "ssa_flash-examples", f"{example}-{mode}")
    return os.path.join(KEPT_MODES_DIR, f"{example}-{mode}")


def git_commit():
    """``(commit, dirty)`` of the checkout holding the examples, ``(None, None)`` outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."], cwd=HERE, capture_output=True,
                               text=True, timeout=10)
        if out.returncode == 0:
            return out.stdout.strip(), bool(dirty.stdout.strip())
    except Exception:
        pass
    return None, None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def provenance(script: str, device, cfg, mode, backend) -> dict:
    """The ``provenance`` record of a results file written by ``script`` (e.g. "examples/icl_linear.py")."""
    commit, dirty = git_commit()
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    return {
        "script": script,
        "argv": sys.argv[1:],
        "mode": mode,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "examples_dirty": dirty,
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "ssa_flash": getattr(ssa_flash, "__version__", None),
        "backend": backend,
        "python": platform.python_version(),
        "steps": cfg["steps"],
        "seeds": {"init": cfg["seed"], "train_data": cfg["data_seed"], "eval": cfg["eval_seed"]},
    }


def resolved_backend(requested, device):
    """The backend ``backend="auto"`` runs on ``device`` (the name given otherwise)."""
    if requested != "auto":
        return requested
    return ssa_flash.available_backends(device)[0]
