"""The documentation runs: every ```python block of README.md, CONTRIBUTING.md and docs/*.md is
executed (one test per block, named ``file:line`` of its fence), and every intra-repository markdown
link and ``#anchor`` must resolve.

Conventions (CONTRIBUTING.md, "Writing docs"): a block runs on the CPU in a fresh namespace, in a
temporary working directory, with ``backend="auto"`` resolving as for a user without a GPU and
without ``TRITON_INTERPRET`` (the reference implementation: the interpreter would take minutes at
example sizes, and the kernels have tests of their own). An HTML comment on the last non-blank line
before the fence changes that::

    <!-- doc-test: continue -->   run in the namespace (and directory) the previous block left
    <!-- doc-test: gpu -->            needs CUDA: only compiled (syntax) when no GPU is present
    <!-- doc-test: compile (why) -->  only compiled, never run (needs a launcher, several
                                      processes, real data...); say why
    <!-- doc-test: skip (why) -->     neither run nor compiled (signatures, pseudo-code); say why

Options combine with commas (``continue, gpu``). A block continuing one that did not run (a GPU
block on a CPU machine) is compiled only; one continuing a block that failed fails.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# The documentation: the files whose python blocks run and whose links are checked.
DOC_FILES = [p for p in (ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(ROOT.glob("docs/*.md")))
             if p.is_file()]
# Every markdown file of the repository (links are checked in all of them).
LINK_FILES = sorted(p for p in ROOT.rglob("*.md")
                    if not any(part.startswith(".") or part in ("node_modules", "build", "dist")
                               for part in p.relative_to(ROOT).parts[:-1]))

OPTIONS = ("continue", "gpu", "compile", "skip")
_DIRECTIVE = re.compile(r"<!--\s*doc-test:\s*(.*?)\s*-->")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    lang: str
    code: str
    options: Tuple[str, ...]
    reason: str
    error: str = ""    # a malformed directive

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def parse_directive(text: str) -> Tuple[Tuple[str, ...], str, str]:
    """``(options, reason, error)`` of a ``doc-test:`` comment's text, e.g. ``"continue, gpu"``
    or ``"skip (a signature)"``."""
    reason = " ".join(re.findall(r"\(([^)]*)\)", text)).strip()
    words = [w for w in re.split(r"[,\s]+", re.sub(r"\([^)]*\)", " ", text)) if w]
    bad = [w for w in words if w not in OPTIONS]
    error = f"unknown doc-test option(s) {bad}; known: {OPTIONS}" if bad else ""
    for opt in ("skip", "compile"):
        if opt in words and not reason:
            error = error or f"doc-test: {opt} needs a reason in parentheses, e.g. {opt} (a signature)"
    return tuple(w for w in words if w in OPTIONS), reason, error


def code_blocks(path: Path) -> List[Block]:
    """The fenced code blocks of a markdown file, with the directive above each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        d = _DIRECTIVE.search(prev)
        options, reason, error = parse_directive(d.group(1)) if d else ((), "", "")
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", options, reason, error))
    return blocks


def python_blocks() -> List[Block]:
    return [b for p in DOC_FILES for b in code_blocks(p) if b.lang in ("python", "py", "python3")]


PY_BLOCKS = python_blocks()
_BY_NAME = {b.name: b for b in PY_BLOCKS}


def _compiled(block: Block):
    # leading newlines: tracebacks and syntax errors point at the markdown file's own lines
    return compile("\n" * block.line + block.code, str(block.path.relative_to(ROOT)), "exec")


def _previous(block: Block) -> Optional[Block]:
    same = [b for b in PY_BLOCKS if b.path == block.path and b.line < block.line]
    return same[-1] if same else None


class _Result:
    def __init__(self, status: str, ns: Optional[dict] = None, cwd: Optional[Path] = None, why: str = ""):
        self.status, self.ns, self.cwd, self.why = status, ns, cwd, why


_results: Dict[str, _Result] = {}


def _run(block: Block, workdir_factory) -> _Result:
    """Runs ``block`` (after the blocks it continues), once per session."""
    if block.name in _results:
        return _results[block.name]
    if block.error:
        res = _Result("failed", why=block.error)
    elif "skip" in block.options:
        res = _Result("not run", why=f"doc-test: skip ({block.reason})")
    else:
        code = _compiled(block)
        ns, cwd, res = None, None, None
        if "continue" in block.options:
            prev = _previous(block)
            if prev is None:
                res = _Result("failed", why="doc-test: continue on the file's first python block")
            else:
                before = _run(prev, workdir_factory)
                if before.status == "failed":
                    res = _Result("failed", why=f"continues {prev.name}, which failed: {before.why}")
                elif before.status != "ok":
                    res = _Result("not run", why=f"continues {prev.name}, which did not run ({before.why})")
                else:
                    ns, cwd = before.ns, before.cwd
        else:
            ns, cwd = {"__name__": "__doc_test__"}, workdir_factory()
            torch.manual_seed(0)
        if res is None and "compile" in block.options:
            res = _Result("not run", why=f"doc-test: compile ({block.reason}): compiled only")
        if res is None and "gpu" in block.options and not torch.cuda.is_available():
            res = _Result("not run", why="doc-test: gpu, and no CUDA device here (compiled only)")
        if res is None:
            old = os.getcwd()
            os.chdir(cwd)
            try:
                exec(code, ns)
                res = _Result("ok", ns, cwd)
            except BaseException as err:  # noqa: BLE001 - reported by the block's test
                res = _Result("failed", why=f"{type(err).__name__}: {err}")
                _results[block.name] = res
                raise
            finally:
                os.chdir(old)
    _results[block.name] = res
    return res


@pytest.fixture
def as_cpu_user(monkeypatch):
    """``backend="auto"`` as without TRITON_INTERPRET: the reference on CPU tensors."""
    from ssa_flash.backends import triton_backend

    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    return lambda: tmp_path_factory.mktemp("doc")


def test_there_are_python_blocks():
    assert len(PY_BLOCKS) >= 10, [b.name for b in PY_BLOCKS]


@pytest.mark.parametrize("name", [b.name for b in PY_BLOCKS])
def test_python_block(name, as_cpu_user, workdirs):
    block = _BY_NAME[name]
    assert not block.error, block.error
    if "skip" not in block.options:
        _compiled(block)  # a syntax error fails even a GPU block on a CPU machine
    res = _run(block, workdirs)
    if res.status == "failed":
        pytest.fail(res.why)
    if res.status == "not run":
        pytest.skip(res.why)


# --------------------------------------------------------------------------------------------
# The conventions themselves


def test_directive_parsing():
    assert parse_directive("continue, gpu") == (("continue", "gpu"), "", "")
    assert parse_directive("skip (a signature, not code)") == (("skip",), "a signature, not code", "")
    assert parse_directive("skip")[2]                     # a skip must say why
    assert "contine" in parse_directive("contine")[2]     # typos are errors, not silently ignored


def test_blocks_and_directives_are_found(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("text\n\n```python\na = 1\n```\n<!-- doc-test: continue -->\n"
                  "```python\nb = a\n```\n\n<!-- doc-test: gpu -->\n\n```bash\nls\n```\n"
                  "* item\n\n  ```python\n  c = 2\n  ```\n")
    blocks = code_blocks(md)
    assert [(b.line, b.lang, b.code, b.options) for b in blocks] == [
        (3, "python", "a = 1\n", ()), (7, "python", "b = a\n", ("continue",)),
        (13, "bash", "ls\n", ("gpu",)), (18, "python", "c = 2\n", ())]


def test_error_lines_are_the_markdown_lines(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("# t\n\n```python\nx = 1\nraise ValueError('here')\n```\n")
    (block,) = code_blocks(md)
    block.path = ROOT / "x.md"  # _compiled names files relative to the repository
    with pytest.raises(ValueError) as info:
        exec(_compiled(block), {})
    assert info.traceback[-1].lineno + 1 == 5


# --------------------------------------------------------------------------------------------
# Links and anchors


def _strip_code(text: str, inline: bool = True) -> str:
    """The markdown without fenced blocks and (``inline``) inline code: links inside them are not
    links, and a heading's anchor keeps the text of its inline code."""
    out, fence = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
            out.append("")
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
            continue
        out.append(line)
    text = "\n".join(out)
    if inline:  # a code span may wrap onto the next line (not past a blank line); keep line numbers
        text = re.sub(r"(`+)(?:(?!\1)[^\n]|\n(?![ \t]*\n))+?\1", lambda m: "\n" * m.group(0).count("\n"), text)
    return text


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup removed, lower case, characters other than letters,
    digits, ``_``, ``-`` and spaces dropped, spaces made ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    """Every anchor of a markdown file: headings (duplicates numbered -1, -2, ...) and
    explicit ``<a id=...>`` / ``<a name=...>``."""
    text = _strip_code(path.read_text(encoding="utf-8"), inline=False)
    seen: Dict[str, int] = {}
    out = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    for line in text.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)",
                   re.MULTILINE)


def links(path: Path) -> List[Tuple[int, str]]:
    """``(line, target)`` of the markdown links and images of a file (outside code)."""
    text = _strip_code(path.read_text(encoding="utf-8"))
    out = []
    for m in _LINK.finditer(text):
        target = m.group(1) or m.group(2)
        out.append((text.count("\n", 0, m.start()) + 1, target))
    for m in re.finditer(r"!\[[^\]]*\]\(\s*([^)\s]+)", text):
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def broken_links(path: Path) -> List[str]:
    bad = []
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT).as_posix()}:{line}: {target}"
        if not dest.exists():
            bad.append(f"{where}: no file {file_part}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where}: no heading or anchor #{anchor} in {dest.relative_to(ROOT).as_posix()}")
    return bad


def test_slugs_are_githubs():
    assert slug("1. Replace an SDPA call") == "1-replace-an-sdpa-call"
    assert slug("`ssa_flash.nn.SSAttention`") == "ssa_flashnnssattention"
    assert slug("Local attention (`window_size`)") == "local-attention-window_size"
    assert slug("Static audit (no GPU)") == "static-audit-no-gpu"


def test_link_checker_finds_broken_links(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n## Top\n[ok](#top-1) [ok](b.md#sec) [bad](#nope) "
                                   "[bad](c.md) [web](https://x.org/#y) `[code](#no)`\n")
    (tmp_path / "b.md").write_text("## Sec\n")
    globals()["ROOT"], old = tmp_path, ROOT
    try:
        bad = broken_links(tmp_path / "a.md")
    finally:
        globals()["ROOT"] = old
    assert len(bad) == 2 and "#nope" in bad[0] and "c.md" in bad[1], bad


@pytest.mark.parametrize("path", LINK_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(path):
    assert broken_links(path) == []
