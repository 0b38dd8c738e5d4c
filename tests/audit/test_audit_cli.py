"""``python -m ssa_flash.audit``'s command line: ``--quick`` compiles what its help says (the gated
configurations: sm_90, bf16, head dims 64 and 128, no mask; the CUDA C++ kernels narrowed alike),
and every nvcc compile reports progress while it runs. Nothing here compiles a kernel."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from ssa_flash.audit import cuda

# importing the command line drops TRITON_INTERPRET (the audit compiles real kernels); the rest
# of the session runs the interpreter, so the variable is put back
_INTERPRET = os.environ.get("TRITON_INTERPRET")
from ssa_flash.audit import __main__ as cli  # noqa: E402

if _INTERPRET is not None:
    os.environ["TRITON_INTERPRET"] = _INTERPRET

ROOT = Path(__file__).resolve().parents[2]


def _args(*argv):
    return cli.build_parser().parse_args(list(argv))


def test_quick_selects_what_its_help_says():
    help_text = " ".join(cli.build_parser().format_help().split())
    for words in ("sm_90", "bf16", "head dims 64 and 128", "no mask", "CUDA C++"):
        assert words in help_text, words
    variants, filtered, archs = cli.selection(_args("--quick"))
    assert filtered and archs == [90] and variants
    assert {v.arch for v in variants} == {90}
    assert {v.dtype for v in variants} == {"bf16"}
    assert {v.head_dim for v in variants} == {64, 128}
    assert {v.mask for v in variants} == {"none"}
    assert cli.cuda_scope(_args("--quick")) == (["bf16"], [64, 128], False)


def test_cuda_scope_follows_the_selection():
    assert cli.cuda_scope(_args()) == (None, None, True)  # a full run: everything
    assert cli.cuda_scope(_args("--dtypes", "fp16,fp32", "--dims", "128")) == (["fp16"], [128], False)
    assert cli.cuda_scope(_args("--dims", "64", "--features", "none,softcap")) == (None, [64], True)


def test_scope_files_and_flags():
    csrc = ROOT / "csrc"
    every = sorted(csrc.glob("*.cu"))
    assert cuda.scope_files(csrc) == every
    bf16 = cuda.scope_files(csrc, ["bf16"])
    assert bf16 and all("fp16" not in f.name for f in bf16) and any("bf16" in f.name for f in bf16)
    assert cuda.scope_files(csrc, []) == [f for f in every if "bf16" not in f.name and "fp16" not in f.name]
    assert cuda.scope_flags() == []
    flags = cuda.scope_flags([64, 128], extras=False)
    assert "-DSSA_FLASH_EXTRAS=0" in flags
    assert {f for f in flags if "HEAD_DIM" in f} == {"-DSSA_FLASH_HEAD_DIM_32=0", "-DSSA_FLASH_HEAD_DIM_96=0",
                                                      "-DSSA_FLASH_HEAD_DIM_256=0"}
    # a head dim between the compiled ones keeps the next one up (it is zero-padded to it)
    assert "-DSSA_FLASH_HEAD_DIM_128=0" not in cuda.scope_flags([111])
    # the knobs exist in the sources
    dispatch = (csrc / "dispatch.h").read_text()
    assert "SSA_FLASH_EXTRAS" in dispatch and all(f"SSA_FLASH_HEAD_DIM_{d}" in dispatch for d in cuda.HEAD_DIMS)


def test_nvcc_reports_progress_while_it_compiles(tmp_path, monkeypatch):
    """A slow nvcc (a stand-in script) is announced every ``heartbeat_s`` seconds, and its output
    and exit status still come back whole."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "nvcc"
    fake.write_text("#!/bin/sh\nsleep 1\necho 'ptxas info : fake'\necho 'warning: fake' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bindir) + os.pathsep + os.environ.get("PATH", ""))
    src = tmp_path / "k.cu"
    src.write_text("")
    lines = []
    res = cuda.compile_cu(src, 90, tmp_path, progress=lines.append, heartbeat_s=0.2)
    assert res["returncode"] == 3 and res["cubin"] is None
    assert "ptxas info : fake" in res["log"] and "warning: fake" in res["log"]
    assert len(lines) >= 2 and all("k.cu for sm_90a: still compiling" in line for line in lines), lines
