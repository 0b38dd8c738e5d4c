"""Running the audit over many specialisations: capture, compile (in parallel worker processes),
analyse, cache.

Cache: one JSON file per result under ``$SSA_FLASH_AUDIT_CACHE`` (default
``~/.cache/ssa_flash/audit``), keyed by a hash of everything that decides it: the Triton version,
Triton's hash of the kernel's source and the jit functions it calls, the launch (constexprs, block
configuration, argument dtypes / shapes / strides / values), the target, ``TRITON_*`` environment
variables, and the source of the analysing modules of this package (so an analyser change recomputes
too). Any change to a
kernel therefore recompiles it.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import multiprocessing
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterable, List, Optional

from . import specs

_PACKAGE_DIR = Path(__file__).resolve().parent


def cache_dir() -> Path:
    """Where results are cached (``SSA_FLASH_AUDIT_CACHE`` or ``~/.cache/ssa_flash/audit``)."""
    env = os.environ.get("SSA_FLASH_AUDIT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ssa_flash" / "audit"


# The modules whose code decides a cached result (not the table / JSON / CLI code).
_ANALYSER_MODULES = ("analyse.py", "compile.py", "ir.py", "model.py", "resources.py", "runner.py", "sass.py",
                     "specs.py")


@functools.lru_cache(maxsize=None)
def _analyser_hash() -> str:
    """Hash of the analysing modules as this process loaded them (computed once)."""
    h = hashlib.sha256()
    for name in _ANALYSER_MODULES:
        h.update(name.encode())
        h.update((_PACKAGE_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def cache_key(variant: specs.Variant, kl) -> Optional[str]:
    """The cache key of compiling ``kl`` for ``variant`` (None when Triton gives no source hash)."""
    from . import compile as comp

    src = comp.kernel_source_key(kl.kernel)
    if src is None:
        return None
    env = {k: v for k, v in os.environ.items() if k.startswith("TRITON_")}
    blob = json.dumps({"analyser": _analyser_hash(), "triton": comp.triton_version(), "source": src,
                       "arch": variant.arch, "launch": specs.describe_launch(kl), "env": env}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def compile_and_analyse(kl, arch: int, dump_stem: Optional[str] = None) -> dict:
    """Compile one launch (anything with ``kernel``, ``args``, ``constexprs`` and ``blocks`` like
    :class:`~ssa_flash.triton.launch.KernelLaunch`; ``blocks.m x blocks.n`` is the score tile of
    one loop iteration) for ``sm_<arch>`` and analyse it (no cache). With ``dump_stem``, also
    writes ``<stem>.sass``, ``.ptxas.log``, ``.ttir`` and ``.ptx``."""
    from . import analyse, compile as comp

    c = comp.compile_launch(kl, arch)
    text = comp.disassemble(c.cubin)
    res = comp.res_usage(c.cubin)
    ws = getattr(kl.blocks, "ws", False)
    ws_figures = analyse.warp_specialisation(c.ptx, text) if ws else None
    loop_warps, threads = kl.blocks.warps, None
    if ws_figures and ws_figures["threads"]:
        # the score loop runs in the consumer warpgroups, each over its share of the query rows;
        # one warpgroup is the producer (setmaxnreg applies per warpgroup)
        threads = ws_figures["threads"]
        loop_warps = threads // 32 - 4
    r = analyse.analyse_compiled(c.name, text, res, c.ptxas_log, c.ttir, c.shared_bytes,
                                 kl.blocks.m, kl.blocks.n, loop_warps, arch, threads)
    r["blocks"] = {"m": kl.blocks.m, "n": kl.blocks.n, "warps": kl.blocks.warps, "stages": kl.blocks.stages}
    if ws:
        r["blocks"]["ws"] = True
        r["warp_specialized"] = ws_figures
    r["compile_s"] = round(c.compile_s, 2)
    r["ptxas_log_source"] = c.ptxas_log_source
    if dump_stem:
        stem = Path(dump_stem)
        stem.parent.mkdir(parents=True, exist_ok=True)
        for suffix, content in ((".sass", text), (".ptxas.log", c.ptxas_log), (".ttir", c.ttir), (".ptx", c.ptx)):
            Path(str(stem) + suffix).write_text(content)
    return r


def _cached(variant, kl, use_cache: bool, dump_dir: Optional[str]):
    key = cache_key(variant, kl) if use_cache and not dump_dir else None
    path = cache_dir() / f"{key}.json" if key else None
    if path is not None and path.is_file():
        try:
            r = json.loads(path.read_text())
            r["cached"] = True
            return r
        except (OSError, ValueError):
            pass
    stem = None
    if dump_dir:
        b = kl.blocks
        stem = str(Path(dump_dir) / f"{variant.id}-{b.m}x{b.n}w{b.warps}s{b.stages}")
    r = compile_and_analyse(kl, variant.arch, stem)
    r["cached"] = False
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(r))
            os.replace(tmp, path)
        except OSError:
            pass
    return r


def audit_variant(variant: specs.Variant, all_candidates: bool = False, use_cache: bool = True,
                  dump_dir: Optional[str] = None) -> dict:
    """Audit one specialisation: compile the launcher's first block configuration, and the next
    ones while a configuration does not fit the target (as the launcher falls back on a GPU), or
    all of them with ``all_candidates``. The result's ``chosen`` is the configuration the launcher
    would run."""
    start = time.monotonic()
    first = specs.capture(variant)
    n_cands = len(first.candidates)
    configs = []
    chosen = None
    for i in range(n_cands):
        kl = first if i == 0 else specs.capture(variant, i)
        r = _cached(variant, kl, use_cache, dump_dir)
        r["candidate"] = i
        configs.append(r)
        if chosen is None and r["fits"]:
            chosen = len(configs) - 1
            if not all_candidates:
                break
    return {"id": variant.id, "variant": variant.to_dict(), "candidates": n_cands,
            "chosen": chosen, "configs": configs, "wall_s": round(time.monotonic() - start, 2)}


def _worker(args):
    variant, all_candidates, use_cache, dump_dir = args
    try:
        return audit_variant(variant, all_candidates, use_cache, dump_dir)
    except Exception as err:  # noqa: BLE001 - reported per specialisation, the run goes on
        return {"id": variant.id, "variant": variant.to_dict(), "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(), "configs": [], "chosen": None}


def _init_worker():
    """Worker start: no interpreter, the analysing modules loaded and hashed together."""
    import warnings

    os.environ.pop("TRITON_INTERPRET", None)
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    from . import analyse, compile  # noqa: F401
    _analyser_hash()


def run(variants: Iterable[specs.Variant], jobs: int = 1, all_candidates: bool = False, use_cache: bool = True,
        dump_dir: Optional[str] = None, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """Audit ``variants`` with ``jobs`` worker processes (1: in this process). Results come back
    in the order of ``variants``."""
    variants = list(variants)
    tasks = [(v, all_candidates, use_cache, dump_dir) for v in variants]
    results: List[Optional[dict]] = [None] * len(tasks)
    start = time.monotonic()

    def report(i, r, done):
        if progress is None:
            return
        if r.get("error"):
            status = "ERROR " + r["error"].splitlines()[0][:120]
        else:
            c = r["configs"][r["chosen"]] if r["chosen"] is not None else (r["configs"][-1] if r["configs"] else {})
            status = f"{'cached' if c.get('cached') else str(c.get('compile_s', '?')) + ' s'}"
        progress(f"[{done}/{len(tasks)} {time.monotonic() - start:6.0f} s] {variants[i].id}: {status}")

    if jobs <= 1 or len(tasks) <= 1:
        _init_worker()
        for i, t in enumerate(tasks):
            results[i] = _worker(t)
            report(i, results[i], i + 1)
        return results
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_init_worker) as pool:
        futures = {pool.submit(_worker, t): i for i, t in enumerate(tasks)}
        done = 0
        for fut in concurrent.futures.as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            done += 1
            report(i, results[i], done)
    return results


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
