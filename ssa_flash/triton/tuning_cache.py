"""The tuning cache: the block configuration timed fastest for a kernel specialisation, filed on
disk (``$SSA_FLASH_CACHE_DIR`` or ``~/.cache/ssa_flash/autotune``) under a key made of everything
that decides the winner (GPU model, torch / Triton / ssa_flash versions, the kernel's source
closure, the specialisation, the size bucket, the candidate list), so that a later process reads
the choice instead of timing again (``block_choice.launch_kernel``)."""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch
import triton
import triton.language as tl

from .._version import __version__ as _VERSION
from .tiles import Blocks

# Tuned choices on disk, one small JSON file per choice (see cache_key); writes go to a
# temporary file in the same folder renamed over the target, so readers never see half a file.
CACHE_ENV = "SSA_FLASH_CACHE_DIR"
logger = logging.getLogger("ssa_flash")



def cache_dir() -> Path:
    """Where tuned block configurations are kept: ``$SSA_FLASH_CACHE_DIR/autotune``, by default
    ``~/.cache/ssa_flash/autotune`` (``$XDG_CACHE_HOME/ssa_flash/autotune`` if that is set)."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "ssa_flash")
    return Path(root) / "autotune"


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def cache_key(kernel, name, device, head_block, dtype, bucket, consts, cands) -> Optional[str]:
    """The text a tuned choice is filed under: everything that decides which configuration wins
    (the GPU model, torch, Triton and ssa_flash versions, the kernel's source with the JIT
    functions it calls, as Triton keys its compiled kernels, the specialisation, the size bucket
    and the candidate list). None when it cannot be formed (nothing is cached then)."""
    try:
        source = kernel_identity(kernel)
        parts = (f"gpu={gpu_name(device)}", f"torch={torch.__version__}", f"triton={triton.__version__}",
                 f"ssa_flash={_VERSION}", f"kernel={source}", f"name={name}", f"head_block={head_block}",
                 f"dtype={dtype}", f"bucket={bucket}", f"consts={sorted((k, repr(v)) for k, v in consts.items())}",
                 f"candidates={[tuple(block_list(c)) for c in cands]}")
        return "\n".join(parts)
    except Exception as err:  # e.g. no device name: tune, but keep the choice in memory only
        logger.debug("ssa_flash: no autotuning cache key (%r)", err)
        return None


def _jit_name(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", type(kernel).__name__)


_identities: dict = {}  # id(kernel) -> (kernel, identity): kept per process, computed once


def kernel_identity(kernel) -> str:
    """``<kernel name>:<hash>``, what the tuning cache files a choice under for the kernel's code:
    sha256 over the source of ``kernel`` and of every JIT function it refers to, transitively
    (each by module, name and source text, in name order), and the ``tl.constexpr`` globals they
    read (name and value). It covers what Triton's ``cache_key`` covers, less line numbers (a
    shifted kernel keeps its tunings), and reads the same wherever the sources are the same: Triton
    3.6's ``cache_key`` of identical sources differed between the GPU machine (Python 3.12) and
    the CPU machines (Python 3.11; the cause not pinned down), so that entries could neither be
    checked nor carried over a kernel edit away from the GPU (bench/rekey_tuning.py). The same
    here under Triton 3.6 and 3.9 (Triton's own functions are named by its version). A stand-in
    without Python source: :func:`_source_hash`."""
    hit = _identities.get(id(kernel))
    if hit is not None and hit[0] is kernel:
        return hit[1]
    fn = getattr(kernel, "fn", None)
    if not callable(fn):
        return _source_hash(kernel)
    try:
        identity = f"{_jit_name(kernel)}:{_closure_hash(kernel)}"
    except (OSError, TypeError, SyntaxError):  # no source to read
        return _source_hash(kernel)
    _identities[id(kernel)] = (kernel, identity)
    return identity


def _is_jit(val) -> bool:
    """A Triton JIT function (or the interpreter's stand-in for one): a Triton object wrapping ``fn``."""
    return callable(getattr(val, "fn", None)) and type(val).__module__.startswith("triton")


def _closure_hash(kernel) -> str:
    import ast
    import textwrap
    import types

    sources, consts, todo = {}, {}, [kernel]
    while todo:
        jf = todo.pop()
        fn = jf.fn
        name = f"{fn.__module__}.{fn.__qualname__}"
        if name in sources or (fn.__module__ or "").startswith("triton"):
            continue  # Triton's own library functions: the key names Triton's version
        src = textwrap.dedent(inspect.getsource(fn))
        sources[name] = f"{src}\0noinline={getattr(jf, 'noinline', None)}"
        scope = fn.__globals__

        def resolve(node):
            if isinstance(node, ast.Name):
                return scope.get(node.id)
            if isinstance(node, ast.Attribute):
                base = resolve(node.value)
                return getattr(base, node.attr, None) if isinstance(base, types.ModuleType) else None
            return None

        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, (ast.Name, ast.Attribute)):
                continue
            val = resolve(node)
            if _is_jit(val):
                todo.append(val)
            elif isinstance(val, tl.constexpr):
                label = node.id if isinstance(node, ast.Name) else ast.unparse(node)
                consts[f"{fn.__module__}:{label}"] = repr(getattr(val, "value", val))
    h = hashlib.sha256()
    for name in sorted(sources):
        h.update(f"{name}\0{sources[name]}\0".encode("utf-8"))
    for name in sorted(consts):
        h.update(f"{name}={consts[name]}\0".encode("utf-8"))
    return h.hexdigest()


def _source_hash(kernel) -> str:
    """A kernel without Triton's ``cache_key`` (the interpreter's, a test's stand-in): its name
    and a hash of its Python source where there is one."""
    try:
        src = inspect.getsource(getattr(kernel, "fn", kernel))
    except (OSError, TypeError):
        src = ""
    return f"{_jit_name(kernel)}:{hashlib.sha256(src.encode('utf-8')).hexdigest()[:16]}"


def cache_path(key: str) -> Path:
    return cache_dir() / (hashlib.sha256(key.encode("utf-8")).hexdigest()[:32] + ".json")


def cache_load(key: Optional[str], cands) -> Optional[Blocks]:
    """The choice filed under ``key`` if it is one of ``cands``, else None. A missing, unreadable,
    corrupt or foreign file is None: the caller tunes again."""
    if key is None:
        return None
    try:
        data = json.loads(cache_path(key).read_text())
        if data.get("key") != key:
            return None
        blk = Blocks(*(int(x) for x in data["blocks"][:4]), *(bool(x) for x in data["blocks"][4:5]))
    except Exception:
        return None
    return blk if blk in cands else None


def block_list(blk: Blocks) -> list:
    """``blk`` as the cache files list it: ``[m, n, warps, stages]``, ``+ [1]`` if warp-specialised."""
    return [blk.m, blk.n, blk.warps, blk.stages] + ([1] if blk.ws else [])


def cache_store(key: Optional[str], blk: Blocks, timings) -> None:
    """File ``blk`` under ``key`` (atomically: temporary file + rename). Failing to write (a
    read-only home, a full disk) only costs the next process a new tuning."""
    if key is None:
        return
    tmp = None
    try:
        path = cache_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"key": key, "blocks": block_list(blk), "timings_ms": [[block_list(c), ms] for c, ms in timings]}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
        tmp = None
    except Exception as err:
        logger.debug("ssa_flash: could not write the autotuning cache (%r)", err)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
