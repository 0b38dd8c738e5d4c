"""Packaging: the sdist is a tree the tests run on, the metadata (license, classifiers, py.typed),
setup.py's decisions (setuptools floor, architecture list, falling back to pure Python when the
extension fails to build), the CUDA extension's kernel images against the GPU, and where the CUDA
sources are found once installed.

Everything here is offline: the sdist and wheel are built with this environment's setuptools
(``python setup.py sdist``, ``pip wheel --no-build-isolation --no-deps``).
"""
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ssa_flash.backends import _cuda_build as cb  # noqa: E402


def _setuptools_version():
    try:
        import setuptools
    except ImportError:
        return None
    return tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])


_ST = _setuptools_version()
needs_setuptools = pytest.mark.skipif(
    _ST is None or _ST < (77, 0),
    reason='building needs setuptools >= 77 in this environment (pip install -U "setuptools>=77"; .ci/run does)')


def load_setup_module():
    """setup.py as a module, without running setup()."""
    spec = importlib.util.spec_from_file_location("ssa_flash_setup_script", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _clean_env():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("SSA_FLASH_BUILD_CUDA", None)
    return env


# ------------------------------------------------------------------------------------------------
# The sdist


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """(path of the .tar.gz, its member names without the top folder, the unpacked root)."""
    out = tmp_path_factory.mktemp("sdist")
    # egg-info outside the tree: a SOURCES.txt left by an earlier build would add its files
    egg_base = tmp_path_factory.mktemp("egg_base")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(egg_base),
                           "sdist", "-d", str(out)], cwd=ROOT,
                          env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (archive,) = out.glob("ssa_flash-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        # (the "data" filter where this Python has it: 3.12+ warns without a filter)
        tar.extractall(out / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    top = names[0].split("/")[0]
    members = {n.split("/", 1)[1] for n in names if "/" in n}
    return archive, members, out / "unpacked" / top


def _tracked(folder):
    """Files under ROOT/folder, as the sdist names them (no caches, no build outputs)."""
    skip = re.compile(r"(__pycache__|\.pyc$|\.so$|\.o$)")
    return {str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*")
            if p.is_file() and not skip.search(str(p))}


@needs_setuptools
def test_sdist_has_what_the_tests_need(sdist):
    _, members, _ = sdist
    must = {"LICENSE", "README.md", "pyproject.toml", "setup.py", "MANIFEST.in", "ssa_flash/py.typed",
            "csrc/api.cpp", "tests/conftest.py", "tests/attn_testing.py", "tests/emulation.py",
            "tests/dist_harness.py", "tests/emu_harness.py", "examples/make_tables.py",
            "tools/nvrtc_build.py"}
    assert must <= members, sorted(must - members)
    for folder in ("tests", "docs", "examples", "csrc", "tools"):
        missing = _tracked(folder) - members
        assert not missing, f"{folder}/ files missing from the sdist: {sorted(missing)[:20]}"
    assert not [m for m in members if "__pycache__" in m or m.endswith((".pyc", ".so", ".o"))]


@needs_setuptools
def test_sdist_metadata(sdist):
    _, _, root = sdist
    info = (root / "PKG-INFO").read_text()
    assert re.search(r"^License-Expression: Apache-2\.0$", info, flags=re.M), info[:2000]
    assert re.search(r"^License-File: LICENSE$", info, flags=re.M)
    classifiers = re.findall(r"^Classifier: (.*)$", info, flags=re.M)
    assert "Typing :: Typed" in classifiers and "Environment :: GPU :: NVIDIA CUDA" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639: no license classifiers
    # the classic field beside the expression, for older pips (`pip show`) and pre-2.4 readers
    assert re.search(r"^License: Apache-2\.0$", info, flags=re.M), info[:2000]
    assert re.search(r"^Author: ", info, flags=re.M)
    urls = re.findall(r"^Project-URL: [^,]+, (\S+)$", info, flags=re.M)
    readme = (ROOT / "README.md").read_text()
    # each URL is one README.md cites (the papers): none is invented
    assert urls and all(u.rsplit("/", 1)[-1] in readme for u in urls), urls
    from packaging.metadata import Metadata

    meta = Metadata.from_email(info, validate=True)  # what PyPI and pip parse
    assert meta.license == meta.license_expression == "Apache-2.0"


@pytest.mark.slow
@needs_setuptools
def test_pytest_collects_in_the_unpacked_sdist(sdist):
    _, _, root = sdist
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=root, env=_clean_env(), capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]  # (a collection error exits 2)
    assert re.search(r"^\d+ tests collected", out, flags=re.M), out[-2000:]


@needs_setuptools
def test_wheel_from_the_sdist_ships_py_typed_csrc_and_license(sdist, tmp_path):
    _, _, root = sdist
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
                           "-w", str(tmp_path), str(root)], env=dict(_clean_env(), SSA_FLASH_BUILD_CUDA="0"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("ssa_flash-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "ssa_flash/py.typed" in names
    assert "ssa_flash/_csrc/api.cpp" in names
    assert any(n.startswith("ssa_flash/_csrc/") and n.endswith(".cu") for n in names)
    # the headers of csrc/ subfolders that the units include (launch_impl.h: hopper/fwd_launch.h)
    assert "ssa_flash/_csrc/hopper/fwd_launch.h" in names
    assert any(re.fullmatch(r"ssa_flash-[^/]+\.dist-info/licenses/LICENSE", n) for n in names), sorted(names)[-10:]


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "Apache-2\.0"$', pyproject, flags=re.M)
    assert re.search(r'^license-files = \["LICENSE"\]$', pyproject, flags=re.M)
    assert (ROOT / "ssa_flash" / "py.typed").is_file()


def test_pyproject_declares_the_gpu_smoke_marker():
    assert re.search(r'"gpu_smoke: GPU smoke tier: one call per kernel family, under 5 minutes on one GPU"',
                     (ROOT / "pyproject.toml").read_text())


# ------------------------------------------------------------------------------------------------
# setup.py's decisions


def test_importing_setup_py_runs_nothing(monkeypatch):
    import setuptools

    calls = []
    monkeypatch.setattr(setuptools, "setup", lambda **kw: calls.append(kw))
    mod = load_setup_module()
    assert calls == [] and callable(mod.main)


def test_setuptools_floor_message():
    mod = load_setup_module()
    msg = mod.setuptools_problem("65.5.0")  # Python 3.11's venv
    assert msg is not None and 'pip install -U "setuptools>=77"' in msg and "bdist_wheel" in msg
    assert mod.setuptools_problem("77.0.3") is None and mod.setuptools_problem("84.2.1") is None


def test_setup_py_stops_early_on_an_old_setuptools(tmp_path):
    """An old setuptools earlier on the path: setup.py exits 1 with the message instead of failing
    later with "invalid command 'bdist_wheel'"."""
    fake = tmp_path / "setuptools"
    (fake / "command").mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '65.5.0'\ndef setup(**kw):\n    raise SystemExit('setup ran')\n")
    (fake / "command" / "__init__.py").write_text("")
    (fake / "command" / "build_py.py").write_text("class build_py:\n    pass\n")
    env = dict(_clean_env(), PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, str(ROOT / "setup.py"), "--version"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert 'pip install -U "setuptools>=77"' in proc.stderr and "setup ran" not in proc.stderr + proc.stdout


def test_arch_list(monkeypatch, capsys):
    mod = load_setup_module()
    monkeypatch.setattr(mod, "nvcc_supports", lambda arch, home: False)
    default = mod.arch_list({}, None)
    assert default == cb.DEFAULT_ARCH_LIST
    assert "9.0a" in default.split(";") and "9.0" not in default.split(";")
    # PTX of the newest architecture whose PTX ports (not the arch-specific 9.0a)
    assert [a for a in default.split(";") if a.endswith("+PTX")] == ["8.9+PTX"]
    monkeypatch.setattr(mod, "nvcc_supports", lambda arch, home: arch == "70")
    assert mod.arch_list({}, None) == "7.0;" + cb.DEFAULT_ARCH_LIST
    capsys.readouterr()
    assert mod.arch_list({"TORCH_CUDA_ARCH_LIST": "8.0 9.0"}, None) == "8.0;9.0a"
    assert "9.0 built as 9.0a" in capsys.readouterr().err


def test_normalize_arch_list():
    assert cb.normalize_arch_list("9.0")[0] == "9.0a"
    assert cb.normalize_arch_list("8.0;9.0a")[0] == "8.0;9.0a" and cb.normalize_arch_list("8.0;9.0a")[1] == []
    archs, notes = cb.normalize_arch_list("8.0;9.0+PTX")
    assert archs == "8.0;9.0+PTX" and len(notes) == 1 and "wgmma" in notes[0]
    assert cb.normalize_arch_list("9.0;9.0a")[0] == "9.0a"


class _FailingBuild:
    """Stands in for torch's BuildExtension whose build_extensions raises."""

    error = RuntimeError("The detected CUDA version (13.0) mismatches the version that was used to compile "
                         "PyTorch (12.8)")

    def __init__(self):
        self.extensions = ["ssa_flash._C"]

    def build_extensions(self):
        if self.error is not None:
            raise self.error


def test_build_ext_falls_back_to_pure_python(monkeypatch, capsys):
    mod = load_setup_module()
    cls = mod.fall_back_on_failure(_FailingBuild)
    monkeypatch.delenv("SSA_FLASH_BUILD_CUDA", raising=False)
    cmd = cls()
    cmd.build_extensions()  # no exception
    assert cmd.extensions == []
    err = capsys.readouterr().err
    assert "the CUDA extension failed to build" in err and "mismatches the version" in err
    assert "pure-Python package" in err and "SSA_FLASH_BUILD_CUDA=1" in err
    monkeypatch.setenv("SSA_FLASH_BUILD_CUDA", "1")
    with pytest.raises(RuntimeError, match="mismatches"):
        cls().build_extensions()


def test_build_ext_keeps_a_successful_build(monkeypatch):
    mod = load_setup_module()

    class Ok(_FailingBuild):
        error = None

    monkeypatch.delenv("SSA_FLASH_BUILD_CUDA", raising=False)
    cmd = mod.fall_back_on_failure(Ok)()
    cmd.build_extensions()
    assert cmd.extensions == ["ssa_flash._C"]


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
@needs_setuptools
def test_build_ext_compiler_error_installs_pure_python(tmp_path):
    """torch's BuildExtension (ninja) on a source that does not compile, through setuptools: the
    command succeeds without the extension and says why."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    (tmp_path / "setup.py").write_text(f"""
import importlib.util
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension
spec = importlib.util.spec_from_file_location("s", {str(ROOT / 'setup.py')!r})
s = importlib.util.module_from_spec(spec)
spec.loader.exec_module(s)
setup(name="pkg", version="0", packages=["pkg"],
      ext_modules=[CppExtension("pkg._C", ["broken.cpp"])],
      cmdclass={{"build_ext": s.fall_back_on_failure(BuildExtension.with_options(use_ninja=True))}})
""")
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path, env=_clean_env(),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "the CUDA extension failed to build" in out and "pure-Python package" in out
    assert not list(pkg.glob("_C*.so"))
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path,
                          env=dict(_clean_env(), SSA_FLASH_BUILD_CUDA="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0


# ------------------------------------------------------------------------------------------------
# Kernel images of a built extension


def _entry(kind, arch, suffix="", payload=b"\0" * 24):
    flags = 0x11 | (0x100000 if suffix == "a" else 0x200000 if suffix == "f" else 0) | (0x8000 if kind == 1 else 0)
    head = 64
    h = struct.pack("<HHIQ", kind, 0x101, head, len(payload)) + b"\0" * 12 + struct.pack("<I", arch)
    h += b"\0" * 8 + struct.pack("<Q", flags)
    return h + b"\0" * (head - len(h)) + payload


def fake_fatbin(*entries):
    """A fat binary as nvcc lays it out: (kind 1 PTX / 2 cubin, arch, suffix) per entry."""
    body = b"".join(_entry(*e) for e in entries)
    return struct.pack("<IHHQ", cb.FATBIN_MAGIC, 1, 16, len(body)) + body


def test_parse_fatbins_reads_architectures_and_skips_noise():
    junk = struct.pack("<IHHQ", cb.FATBIN_MAGIC, 7, 16, 10 ** 9)  # a magic number that heads nothing
    data = b"ELF..." + junk + fake_fatbin((2, 80), (2, 90, "a"), (1, 89)) + b"\0" * 8 + fake_fatbin((2, 75), (2, 80))
    images = cb.parse_fatbins(data)
    assert images == (cb.Image("sm", 80), cb.Image("sm", 90, "a"), cb.Image("ptx", 89), cb.Image("sm", 75))


@pytest.mark.parametrize("images, capability, runs", [
    ([("sm", 80)], (8, 6), True),            # a cubin runs on later minors of its major
    ([("sm", 80)], (9, 0), False),
    ([("sm", 86)], (8, 0), False),
    ([("sm", 90, "a")], (9, 0), True),
    ([("sm", 90, "a")], (10, 0), False),
    ([("ptx", 89)], (10, 0), True),          # PTX: any later architecture (driver JIT)
    ([("ptx", 89)], (12, 0), True),
    ([("ptx", 89)], (8, 6), False),
    ([("ptx", 90, "a")], (10, 0), False),    # arch-specific PTX does not port
    ([("sm", 100, "f")], (10, 3), True),
    ([("sm", 100, "f")], (12, 0), False),
])
def test_image_reason(images, capability, runs):
    why = cb.image_reason(capability, [cb.Image(*im) for im in images])
    assert (why is None) == runs, why
    if not runs:
        arch = f"sm_{capability[0]}{capability[1]}"
        assert "no kernel image" in why and arch in why and "TORCH_CUDA_ARCH_LIST" in why


def test_image_reason_without_images_knows_nothing():
    assert cb.image_reason((10, 0), []) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_default_arch_list_runs_on_newer_gpus(tmp_path, monkeypatch):
    """nvcc builds a shared object with the gencode flags torch derives from the default list
    (newest nvcc: no sm_70): its images run on every listed GPU and, through the PTX, on sm_100
    and sm_120; the same list without +PTX does not."""
    from torch.utils.cpp_extension import _get_cuda_arch_flags

    cu = tmp_path / "k.cu"
    cu.write_text("__global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n"
                  "extern \"C\" void launch(float* x) { k<<<1, 32>>>(x); }\n")

    def build(arch_list, name):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
        so = tmp_path / name
        subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", "-o", str(so), str(cu), *_get_cuda_arch_flags()],
                       check=True, capture_output=True, timeout=600)
        return cb.fatbin_images(so)

    images = build(cb.DEFAULT_ARCH_LIST, "default.so")
    assert cb.Image("sm", 90, "a") in images and cb.Image("ptx", 89) in images
    for cap in [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]:
        assert cb.image_reason(cap, images) is None, cap
    no_ptx = build(cb.DEFAULT_ARCH_LIST.replace("+PTX", ""), "no_ptx.so")
    assert cb.image_reason((10, 0), no_ptx) is not None and cb.image_reason((9, 0), no_ptx) is None


@pytest.fixture
def fake_extension(monkeypatch, tmp_path):
    """The CUDA backend with a loaded 'extension' whose shared object holds the given images, on a
    GPU of the given capability: ``install(capability, *entries)``."""
    from ssa_flash.backends import cuda_backend

    def install(capability, *entries):
        so = tmp_path / f"_C_{len(list(tmp_path.iterdir()))}.so"
        so.write_bytes(b"\x7fELF" + b"\0" * 60 + fake_fatbin(*entries))
        monkeypatch.setattr(cuda_backend, "_ext", type("Ext", (), {"__file__": str(so)})())
        monkeypatch.setattr(cuda_backend, "_capability", lambda device: (*capability, 232448))

    yield install
    cuda_backend._image_reason_for.cache_clear()


def test_backend_refuses_a_gpu_the_extension_has_no_image_for(fake_extension):
    from ssa_flash.backends import cuda_backend

    fake_extension((10, 0), (2, 80), (2, 90, "a"))  # the former default list: no PTX
    why = cuda_backend.unavailable_reason(torch.device("cuda"))
    assert why is not None and "no kernel image for this sm_100 GPU" in why and "sm_90a" in why
    assert not cuda_backend.is_available()
    fake_extension((10, 0), (2, 80), (2, 90, "a"), (1, 89))
    assert cuda_backend.unavailable_reason(torch.device("cuda")) is None
    fake_extension((9, 0), (2, 80), (2, 90, "a"))
    assert cuda_backend.unavailable_reason(torch.device("cuda")) is None


def test_supports_refuses_inputs_on_a_gpu_without_an_image(fake_extension):
    from types import SimpleNamespace

    from ssa_flash.backends import cuda_backend
    from ssa_flash.spec import AttentionSpec

    q = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float16, shape=(1, 2, 8, 64))
    spec = AttentionSpec(scale=0.125)
    fake_extension((12, 0), (2, 80), (2, 90, "a"))
    why = cuda_backend.supports(q, q, q, spec)
    assert why is not None and "no kernel image for this sm_120 GPU" in why
    fake_extension((12, 0), (2, 80), (2, 90, "a"), (1, 89))
    assert cuda_backend.supports(q, q, q, spec) is None


def test_jit_arch_list_builds_9_0_as_9_0a(monkeypatch):
    from ssa_flash.backends import cuda_backend

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    with pytest.warns(UserWarning, match="9.0 built as 9.0a"):
        assert cuda_backend.jit_arch_list() == "8.0;9.0a"


# ------------------------------------------------------------------------------------------------
# Where the CUDA sources are, in a checkout and in an installed package


def test_installed_package_finds_its_shipped_sources(monkeypatch, tmp_path):
    from ssa_flash.audit import cuda as audit_cuda
    from ssa_flash.backends import cuda_backend

    assert cuda_backend.source_dir() == ROOT / "csrc" == audit_cuda.source_dir()  # a checkout
    site = tmp_path / "site-packages"
    shipped = site / "ssa_flash" / "_csrc"
    shipped.mkdir(parents=True)
    for name in ("api.cpp", "fwd_fp16.cu"):
        (shipped / name).write_text("// stub\n")
    monkeypatch.setattr(cuda_backend, "_PACKAGE", site / "ssa_flash")  # no site-packages/csrc
    assert cuda_backend.source_dir() == shipped
    assert audit_cuda.source_dir() == shipped
    why = audit_cuda.unavailable()
    assert why is None or "no .cu files" not in why, why
