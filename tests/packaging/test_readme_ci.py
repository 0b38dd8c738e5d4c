"""The README's quick start and CI cannot drift apart: every numbered command of README.md's quick
start (``# 1.``, ``# 2.``: an install line and what it enables) is a line of ``.ci/run``, verbatim,
in the README's order, and the ``test`` extra that the second one installs holds what the suite
imports (the optional integrations included), so a newcomer's install runs what CI runs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def quick_start_commands():
    """``[(comment, command)]`` of the README's quick-start bash block: each command line with the
    comment line(s) above it."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block, "README.md's quick start has no ```bash block"
    out, comment = [], ""
    for line in block.group(1).splitlines():
        line = line.strip()
        if not line:
            comment = ""
        elif line.startswith("#"):
            comment += line + "\n"
        else:
            out.append((comment, line))
            comment = ""
    return out


def numbered_commands():
    return [cmd for comment, cmd in quick_start_commands() if re.match(r"#\s*\d+\.", comment)]


def ci_lines():
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_readme_numbered_commands_are_the_install_and_run_lines():
    cmds = numbered_commands()
    assert len(cmds) == 2, cmds
    assert all(cmd.startswith("pip install ") for cmd in cmds), cmds
    assert cmds[1].endswith("python -m pytest tests -q"), cmds


#: what .ci/run may append to a README command: under `set -e`, a failure before the last `&&` of
#: a line does not stop a script
EXIT = " || exit 1"


def _ci_line_of(cmd: str, lines) -> int:
    for i, line in enumerate(lines):
        if line in (cmd, cmd + EXIT):
            return i
    raise AssertionError(f".ci/run does not run the README's command as written: {cmd!r}")


def test_ci_runs_the_readme_commands_verbatim_in_order():
    lines = ci_lines()
    at = [_ci_line_of(cmd, lines) for cmd in numbered_commands()]
    assert at == sorted(at), "the README's commands run in another order in .ci/run"
    # nothing runs after the test suite: CI's result is the suite's result
    tail = [line for line in lines[at[-1] + 1:] if line and not line.startswith("#")]
    assert not tail, tail


def test_ci_installs_no_extra_the_readme_does_not():
    """CI's installs of this package are the README's (CI-only setup may install other packages
    first: torch's CPU build, setuptools, the CUDA 12.9 compilers, the audit's Triton versions)."""
    readme = set(numbered_commands())
    own = [line for line in ci_lines() if re.search(r"pip install\b.*\s-e\s", line)]
    assert own and all(line in readme or line[:-len(EXIT)] in readme for line in own), own


def test_a_failing_install_stops_ci():
    """Every README line in .ci/run that chains commands ends in `|| exit 1` (or is the last line)."""
    lines = [line for line in ci_lines() if line and not line.startswith("#")]
    for cmd in numbered_commands():
        i = _ci_line_of(cmd, lines)
        assert lines[i].endswith(EXIT) or i == len(lines) - 1, lines[i]


def test_other_quick_start_commands_are_subsets_of_the_suite():
    """The other commands of the block (the fast tier) select from what command 2 runs."""
    for comment, cmd in quick_start_commands():
        if cmd in numbered_commands():
            continue
        assert cmd.startswith("python -m pytest"), cmd


def test_the_test_extra_holds_what_ci_tests():
    """The optional dependencies the suite exercises (the transformers integration, whose ids
    bench/gpu_recheck.txt names; the benchmark's plots) come with `.[test]`."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]

    def names(reqs):
        return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in reqs}

    test = names(extras["test"])
    for extra in ("triton", "bench", "transformers"):
        assert names(extras[extra]) <= test, (extra, names(extras[extra]) - test)
    assert {"pytest", "hypothesis"} <= test
