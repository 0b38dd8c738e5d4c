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
