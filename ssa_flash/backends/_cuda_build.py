"""Building facts of the CUDA extension: which GPU architectures it is built for, and whether a
built one runs on a GPU.

Standard library only: ``setup.py`` loads this file by path at build time (before the package or
torch can be imported), and :mod:`ssa_flash.backends.cuda_backend` uses it at run time.

* :data:`DEFAULT_ARCH_LIST` and :func:`normalize_arch_list`: the ``TORCH_CUDA_ARCH_LIST`` of a
  build. The kernels' Hopper path (wgmma) exists only in ``sm_90a`` code, so a plain ``9.0``
  becomes ``9.0a``; PTX of the newest portable architecture (``8.9+PTX``) lets GPUs newer than the
  list (sm_100, sm_120) JIT-compile the sm_80 code path instead of failing with "no kernel image".
* :func:`fatbin_images` and :func:`image_reason`: the cubins and PTX embedded in a built extension
  (read from the fat binaries in the shared object) and whether the driver can run any of them on
  a given compute capability.
"""
from __future__ import annotations

import struct
from typing import Iterable, List, NamedTuple, Optional, Tuple

# 9.0a: sm_90a code (the wgmma path) runs on every sm_90 GPU. 8.9+PTX: compute_89 PTX, which the
# driver compiles for any newer GPU (the sm_80 code path; arch-specific "a" PTX would not port).
# A toolkit that still compiles for Volta gets 7.0 in front (setup.py).
DEFAULT_ARCH_LIST = "7.5;8.0;8.6;8.9+PTX;9.0a"


def normalize_arch_list(value: str) -> Tuple[str, List[str]]:
    """``(arch list, notes)``: ``value`` (``TORCH_CUDA_ARCH_LIST`` syntax, ``;`` or space
    separated) with each plain ``9.0`` turned into ``9.0a``, and one sentence per change or
    concern. A ``9.0+PTX`` is kept (its compute_90 PTX is what it asks for) with a note that its
    sm_90 code has no wgmma path."""
    out, notes = [], []
    for token in value.replace(" ", ";").split(";"):
        token = token.strip()
        if not token:
            continue
        if token in ("9.0", "Hopper"):
            notes.append(f"TORCH_CUDA_ARCH_LIST: {token} built as 9.0a (sm_90a: the kernels' wgmma path; "
                         "plain sm_90 code would run the slower sm_80 path on every H100/H200)")
            token = "9.0a"
        elif token == "9.0+PTX":
            notes.append("TORCH_CUDA_ARCH_LIST: 9.0+PTX builds plain sm_90 code, without the kernels' wgmma "
                         "path; add 9.0a (and use 8.9+PTX for PTX) for the fast H100/H200 kernels")
        if token not in out:
            out.append(token)
    return ";".join(out), notes


# --------------------------------------------------------------------------------------------
# The fat binaries of a shared object (the layout nvcc writes, as cuobjdump reads it)

FATBIN_MAGIC = 0xBA55ED50
_KIND_PTX, _KIND_ELF = 1, 2
_FLAG_ARCH_SPECIFIC = 0x100000  # sm_90a, sm_100a: runs on that one architecture only
_FLAG_FAMILY = 0x200000  # sm_100f: runs on that architecture and later minors of its major


class Image(NamedTuple):
    """One embedded image: ``kind`` "sm" (a cubin) or "ptx", ``arch`` 10 major + minor (e.g. 90),
    ``suffix`` "" / "a" (architecture-specific) / "f" (family-specific)."""

    kind: str
    arch: int
    suffix: str = ""

    def describe(self) -> str:
        return f"{'sm' if self.kind == 'sm' else 'compute'}_{self.arch}{self.suffix}" + (
            " (PTX)" if self.kind == "ptx" else "")


def parse_fatbins(data: bytes) -> Tuple[Image, ...]:
    """The images of every fat binary found in ``data`` (a shared object's bytes), in file order
    without repeats. Each fat binary: a 16-byte header (magic, version 1, header size, size of the
    entries), then entries of (kind, version, header size, payload size, ..., arch at byte 28,
    flags at byte 40) each followed by its payload. Anything inconsistent is skipped."""
    images: List[Image] = []
    magic = struct.pack("<I", FATBIN_MAGIC)
    pos = data.find(magic)
    while pos >= 0:
        nxt = pos + 4
        if pos + 16 <= len(data):
            _, version, header, size = struct.unpack_from("<IHHQ", data, pos)
            end = pos + header + size
            found: List[Image] = []
            ok = version == 1 and header >= 16 and end <= len(data)
            p = pos + header
            while ok and p < end:
                if p + 48 > end:
                    ok = False
                    break
                kind, _, ehead, payload = struct.unpack_from("<HHIQ", data, p)
                arch = struct.unpack_from("<I", data, p + 28)[0]
                flags = struct.unpack_from("<Q", data, p + 40)[0]
                if kind not in (_KIND_PTX, _KIND_ELF) or ehead < 48 or not 10 <= arch < 1000:
                    ok = False
                    break
                suffix = "a" if flags & _FLAG_ARCH_SPECIFIC else "f" if flags & _FLAG_FAMILY else ""
                found.append(Image("ptx" if kind == _KIND_PTX else "sm", int(arch), suffix))
                p += ehead + payload
            if ok and p == end:
                images.extend(im for im in found if im not in images)
                nxt = end
        pos = data.find(magic, nxt)
    return tuple(images)


def fatbin_images(path) -> Tuple[Image, ...]:
    """:func:`parse_fatbins` of the file at ``path``; empty when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return parse_fatbins(f.read())
    except OSError:
        return ()


def runs_on(image: Image, arch: int) -> bool:
    """Whether the driver can run ``image`` on a GPU of architecture ``arch`` (10 major + minor):
    a cubin on its major's later minors ("a": on its own architecture only), PTX on any later
    architecture ("a": its own; "f": its major's later minors)."""
    if image.suffix == "a":
        return image.arch == arch
    same_major = image.arch // 10 == arch // 10
    if image.kind == "sm" or image.suffix == "f":
        return same_major and image.arch <= arch
    return image.arch <= arch


def image_reason(capability: Tuple[int, int], images: Iterable[Image]) -> Optional[str]:
    """Why an extension holding ``images`` cannot run on a GPU of compute capability
    ``(major, minor)``, or None (also when ``images`` is empty: nothing is known)."""
    images = tuple(images)
    arch = capability[0] * 10 + capability[1]
    if not images or any(runs_on(im, arch) for im in images):
        return None
    built = ", ".join(im.describe() for im in images)
    return (f"the CUDA extension has no kernel image for this sm_{arch} GPU (built for {built}); "
            f"rebuild it for this GPU, e.g. TORCH_CUDA_ARCH_LIST=\"{capability[0]}.{capability[1]}\" "
            "pip install --no-build-isolation . (docs/cuda.md, Building)")


# --------------------------------------------------------------------------------------------
# Building for the device's architecture only, and from objects compiled elsewhere

# nvcc flags of the extension (cuda_backend.NVCC_FLAGS and setup.py say the same; a test checks it)
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo",
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]

# The sm_90a warp-specialised forward and backward (csrc/hopper/; one flag for both) in a build that
# targets sm_90a: SSA_FLASH_HOPPER_FWD=1 at compile time (csrc/launch_kernel.h). Whether each then
# runs is a run-time choice (SSA_FLASH_HOPPER_FWD=1 / SSA_FLASH_HOPPER_BWD=1 in the environment:
# csrc/hopper/tma_cache.h, bwd_launch.h; or ssa_flash/backends/cuda_fwd_choice.py's table), so one
# build compares them with today's kernels. Builds hold it
# when SSA_FLASH_BUILD_HOPPER_FWD=1 (bench/run_gpu.sh sets it); HOPPER_FWD_DEFAULT says whether
# they do without it (docs/cuda.md, Building: the measured extra compile time decides).
HOPPER_FWD_DEFAULT = False
HOPPER_FWD_ENV = "SSA_FLASH_BUILD_HOPPER_FWD"
# with it, SSA_FLASH_BUILD_HOPPER_MUFU_SWEEP=1 adds the MUFU budgets of the device's sweep
# (csrc/hopper/fwd_launch.h, SSA_FLASH_HOPPER_MUFU_SWEEP: five bf16 SSA instances)
HOPPER_SWEEP_ENV = "SSA_FLASH_BUILD_HOPPER_MUFU_SWEEP"


def hopper_fwd_built(archs: str, environ=None) -> bool:
    """Whether a build for ``archs`` (a ``TORCH_CUDA_ARCH_LIST`` such as ``"8.0;9.0a"`` or an
    object build's ``"90a"``) holds the sm_90a warp-specialised forward and backward."""
    import os

    value = (os.environ if environ is None else environ).get(HOPPER_FWD_ENV)
    wanted = HOPPER_FWD_DEFAULT if value is None else value.strip() == "1"
    return wanted and "90a" in (archs or "").replace(".", "").replace(" ", ";").split(";")


def hopper_fwd_flags(archs: str, environ=None) -> List[str]:
    """The nvcc flags of :func:`hopper_fwd_built` (none, or ``-DSSA_FLASH_HOPPER_FWD=1``, and
    ``-DSSA_FLASH_HOPPER_MUFU_SWEEP=1`` with ``SSA_FLASH_BUILD_HOPPER_MUFU_SWEEP=1``)."""
    import os

    if not hopper_fwd_built(archs, environ):
        return []
    sweep = (os.environ if environ is None else environ).get(HOPPER_SWEEP_ENV, "").strip() == "1"
    return ["-DSSA_FLASH_HOPPER_FWD=1", *(["-DSSA_FLASH_HOPPER_MUFU_SWEEP=1"] if sweep else [])]


CU_UNITS = ("fwd_fp16.cu", "fwd_bf16.cu", "bwd_fp16.cu", "bwd_bf16.cu")
MANIFEST = "manifest.json"


def arch_token(capability: Tuple[int, int]) -> str:
    """``TORCH_CUDA_ARCH_LIST`` token of a GPU of compute capability ``(major, minor)``: sm_90
    as ``9.0a`` (the wgmma path), others as they are."""
    major, minor = capability
    return f"{major}.{minor}{'a' if (major, minor) == (9, 0) else ''}"


def device_arch_list(capabilities: Iterable[Tuple[int, int]]) -> str:
    """``TORCH_CUDA_ARCH_LIST`` naming only the given GPUs' architectures (sorted, no repeats):
    what a JIT build on this machine needs. Each architecture more in the list is one more full
    compile of every kernel instance (an sm_90a build alone took 150-195 s on an H200's host)."""
    return ";".join(arch_token(c) for c in sorted(set(capabilities)))


def arch_count(value: str) -> int:
    """How many architectures a ``TORCH_CUDA_ARCH_LIST`` compiles (each costs a full build)."""
    return len([t for t in value.replace(" ", ";").split(";") if t.strip()])


def csrc_hash(csrc) -> str:
    """sha256 of the extension's sources (``csrc/*.h``, ``*.cuh``, ``*.cu``, ``*.cpp``, with the
    headers of its subfolders such as ``csrc/hopper/`` that the units include; not the CPU
    emulator's ``csrc/emu/``): what the objects are compiled from, each file's path relative to
    ``csrc`` and its bytes, in path order."""
    import hashlib
    from pathlib import Path

    root = Path(csrc)
    h = hashlib.sha256()
    paths = sorted(p for p in root.rglob("*") if p.suffix in (".h", ".cuh", ".cu", ".cpp") and p.is_file()
                   and p.relative_to(root).parts[0] != "emu")
    for path in paths:
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def object_commands(csrc, out_dir, arch: str = "90a", nvcc: str = "nvcc", std: str = "c++17") -> List[List[str]]:
    """The nvcc commands compiling each ``csrc/*.cu`` unit into ``out_dir/<unit>.o`` for ``arch``
    (e.g. "90a"), as the extension build does (flags, position-independent host code). The units
    do not include torch: they compile on any machine with the toolkit, GPU or not."""
    import os

    return [[nvcc, "-c", f"-std={std}", *NVCC_FLAGS, *hopper_fwd_flags(arch), "-gencode", f"arch=compute_{arch},code=sm_{arch}",
             "-Xcompiler", "-fPIC", "-I", str(csrc), os.path.join(str(csrc), unit),
             "-o", os.path.join(str(out_dir), unit[:-3] + ".o")] for unit in CU_UNITS]


def compile_objects(csrc, out_dir, arch: str = "90a", nvcc: str = "nvcc", std: str = "c++17", jobs: int = 2,
                    log=print) -> dict:
    """Compiles the units (``jobs`` nvcc at a time) and writes ``out_dir/manifest.json``:
    ``{"arch", "csrc_hash", "nvcc", "std", "objects": {name: bytes}, "seconds"}``. Raises
    RuntimeError with nvcc's output when a unit fails."""
    import json
    import os
    import subprocess
    import time
    from concurrent.futures import ThreadPoolExecutor

    os.makedirs(out_dir, exist_ok=True)
    t0 = time.monotonic()

    def one(cmd):
        start = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
        log(f"{os.path.basename(cmd[-1])}: {time.monotonic() - start:.0f} s, {os.path.getsize(cmd[-1]) / 2**20:.1f} MiB")
        return os.path.basename(cmd[-1]), os.path.getsize(cmd[-1])

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        sizes = dict(pool.map(one, object_commands(csrc, out_dir, arch, nvcc, std)))
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    manifest = {"arch": arch, "hopper_flags": hopper_fwd_flags(arch), "csrc_hash": csrc_hash(csrc), "nvcc": version[-1] if version else "?", "std": std,
                "objects": sizes, "seconds": round(time.monotonic() - t0, 1)}
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def objects_reason(csrc, obj_dir, arch: str) -> Optional[str]:
    """Why the objects in ``obj_dir`` cannot stand in for a build of ``csrc`` for ``arch``, or None."""
    import json
    import os

    try:
        with open(os.path.join(str(obj_dir), MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        return f"no readable {MANIFEST} in {obj_dir} ({err})"
    if manifest.get("arch") != arch:
        return f"objects for sm_{manifest.get('arch')}, this GPU needs sm_{arch}"
    if list(manifest.get("hopper_flags", [])) != hopper_fwd_flags(arch):
        return (f"objects built with the sm_90a forward's flags {manifest.get('hopper_flags', [])}, this build wants "
                f"{hopper_fwd_flags(arch)} ({HOPPER_FWD_ENV}, {HOPPER_SWEEP_ENV})")
    if manifest.get("csrc_hash") != csrc_hash(csrc):
        return "the objects were compiled from other csrc/ sources (the kernels changed since)"
    missing = [u for u in CU_UNITS if not os.path.isfile(os.path.join(str(obj_dir), u[:-3] + ".o"))]
    if missing:
        return f"objects missing: {', '.join(missing)}"
    return None


def link_extension(csrc, obj_dir, package_dir, verbose: bool = False) -> str:
    """Builds ``ssa_flash._C`` next to the package's modules (``package_dir``) from the binding
    (``csrc/api.cpp``, compiled here against torch: the one unit that includes it) and the
    objects of :func:`compile_objects`; returns the shared object's path. The CUDA backend then
    loads it as a prebuilt extension (no JIT build). Needs torch with CUDA and a toolkit."""
    import glob
    import os
    import shutil
    import sysconfig
    import tempfile

    from torch.utils.cpp_extension import load  # noqa: PLC0415 (torch only here)

    build = tempfile.mkdtemp(prefix="ssa_flash_link_")
    objs = [os.path.abspath(os.path.join(str(obj_dir), u[:-3] + ".o")) for u in CU_UNITS]
    load(name="_C", sources=[os.path.join(str(csrc), "api.cpp")], extra_include_paths=[str(csrc)],
         extra_cflags=["-O3"], extra_ldflags=objs, with_cuda=True, build_directory=build,
         is_python_module=True, verbose=verbose)
    built = glob.glob(os.path.join(build, "_C*.so"))
    if not built:
        raise RuntimeError(f"no _C*.so in {build}")
    dest = os.path.join(str(package_dir), "_C" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    shutil.copy2(built[0], dest)
    return dest


def _main(argv=None) -> int:
    """``python ssa_flash/backends/_cuda_build.py objects|check|link ...`` (standard library only
    for ``objects`` and ``check``: they run on a machine without a GPU)."""
    import argparse
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    p = argparse.ArgumentParser(prog="python ssa_flash/backends/_cuda_build.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, text in (("objects", "compile csrc/*.cu for one architecture (no GPU needed)"),
                       ("check", "exit 0 when the objects match csrc/ and the architecture"),
                       ("link", "build ssa_flash/_C from the objects and csrc/api.cpp (GPU machine)"),
                       ("build", "make the CUDA backend usable on this GPU: link the objects when they "
                                 "match, else JIT-build for --arch only; then one call (GPU machine)")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--out", default=os.path.join(root, "build", "cuda-objects"))
        s.add_argument("--arch", default="90a", help="e.g. 90a, 80")
        s.add_argument("--csrc", default=os.path.join(root, "csrc"))
    sub.choices["objects"].add_argument("--nvcc", default="nvcc")
    sub.choices["objects"].add_argument("--std", default="c++20",
                                        help="C++ standard (torch's extension builds use C++20 from torch 2.10 on)")
    sub.choices["objects"].add_argument("--jobs", type=int, default=2)
    sub.choices["build"].add_argument("--dry", action="store_true",
                                      help="no GPU (a rehearsal): check the objects, build nothing")
    args = p.parse_args(argv)
    if args.cmd == "build":
        return _build(args, root)
    if args.cmd == "objects":
        m = compile_objects(args.csrc, args.out, args.arch, args.nvcc, args.std, args.jobs)
        print(f"{args.out}: {sum(m['objects'].values()) / 2**20:.1f} MiB in {len(m['objects'])} objects, "
              f"{m['seconds']} s")
        return 0
    why = objects_reason(args.csrc, args.out, args.arch)
    if args.cmd == "check":
        print(why or "objects match")
        return 1 if why else 0
    if why:
        print(f"cannot link: {why}")
        return 1
    print(link_extension(args.csrc, args.out, os.path.join(root, "ssa_flash")))
    return 0


def _build(args, root) -> int:
    """The ``build`` command: see :func:`_main`."""
    import os
    import sys
    import time

    t0 = time.monotonic()
    if os.path.isdir(args.out):
        why = objects_reason(args.csrc, args.out, args.arch)
        if why is None and args.dry:
            print(f"dry run: the objects in {args.out} match csrc/ and sm_{args.arch} (not linked)")
            return 0
        import glob

        linked = glob.glob(os.path.join(root, "ssa_flash", "_C*.so"))
        if why is None and linked and os.path.getmtime(linked[0]) > os.path.getmtime(os.path.join(args.out, MANIFEST)):
            print(f"already linked from these objects: {linked[0]}", flush=True)
        elif why is None:
            import subprocess

            try:
                so = link_extension(args.csrc, args.out, os.path.join(root, "ssa_flash"))
                print(f"linked {so} ({time.monotonic() - t0:.0f} s)", flush=True)
                # a fresh process must import it (an unresolved symbol would make every test
                # process fail its import and JIT-build): else it goes, and the JIT build runs
                check = subprocess.run([sys.executable, "-c", "import ssa_flash._C as m; print(m.__file__)"],
                                       cwd=root, capture_output=True, text=True, timeout=120)
                if check.returncode != 0:
                    os.remove(so)
                    print(f"the linked extension does not import ({check.stderr.strip()[-1500:]}): removed, "
                          "JIT build instead", flush=True)
            except Exception as err:  # noqa: BLE001 - any failure: the JIT build instead
                print(f"linking the objects failed ({type(err).__name__}: {str(err)[-2000:]}): JIT build instead",
                      flush=True)
        else:
            print(f"objects in {args.out} not used: {why}", flush=True)
    else:
        print(f"no objects in {args.out}: JIT build", flush=True)
    if args.dry:
        print("dry run: nothing built (the CPU emulator stands in)")
        return 0
    import re

    m = re.fullmatch(r"(\d+)(\d)([a-z]?)", args.arch)
    if m is None:
        print(f"--arch {args.arch!r}: expected e.g. 90a, 80, 100a")
        return 2
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{m[1]}.{m[2]}{m[3]}"  # this GPU only, not the image's list
    import subprocess

    # the package in a fresh process (this module is below it: it imports none of it)
    return subprocess.run([sys.executable, "-c", _FIRST_CALL, str(t0)], cwd=root).returncode


# ``build``'s last step: load the CUDA backend (the prebuilt extension or a JIT build for
# TORCH_CUDA_ARCH_LIST) and make one call; exit 1 when the backend is still unavailable.
_FIRST_CALL = """
import os, sys, time
import torch
import ssa_flash
from ssa_flash.backends import cuda_backend
print(f"TORCH_CUDA_ARCH_LIST {os.environ['TORCH_CUDA_ARCH_LIST']}; "
      f"{'prebuilt ssa_flash._C' if cuda_backend.ready() else 'JIT build'}", flush=True)
ext = cuda_backend.load_extension()
q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
ssa_flash.ssa_attention(q, q, q, backend="cuda")
torch.cuda.synchronize()
print(f"CUDA backend loaded and ran: {getattr(ext, '__file__', ext)} ({time.monotonic() - float(sys.argv[1]):.0f} s)")
why = cuda_backend.unavailable_reason(torch.device("cuda"))
print(f"unavailable_reason: {why!r}")
sys.exit(1 if why else 0)
"""


if __name__ == "__main__":
    import sys

    sys.exit(_main())
