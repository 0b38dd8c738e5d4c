"""CI's checks of the CUDA C++ sources, none needing a GPU:

1. Every ``csrc/*.cu`` compiles with ``nvcc -c`` to SASS for sm_80 and sm_90a (so ptxas validates
   every inline-asm ``mma.sync`` / ``ldmatrix`` / ``cp.async`` and every template instantiation
   the extension ships), with no compiler warning pointing into csrc/; the torch binding
   ``csrc/api.cpp`` compiles against torch's headers; the tile table the Python wrapper mirrors
   (``ssa_flash.cuda._smem_bytes``) matches ``csrc/traits.h``.
2. The kernels *run*, on the CPU: ``csrc/emu`` compiles the real kernels and launch code with a
   host compiler against an emulation of threads, barriers, shuffles, ``ldmatrix``, ``mma.sync``
   and ``cp.async`` written from the PTX ISA's definitions, and the results are held to the GPU
   tests' rule (FlashAttention's: error <= 2x the same-dtype naive error + a floor, against the
   float64 reference) over the four variants, masks, causality, GQA, odd head dims and lengths,
   plus bitwise independence from the thread schedule and from when ``cp.async`` copies (and
   ``wgmma`` operations) complete; the sm_70, sm_75 and sm_90a code paths in builds of their own.
   What it cannot show: hardware timing, true concurrency effects beyond the schedules tried, a
   misreading of the PTX ISA shared by the kernels and the emulation, and speed.

Skipped when nvcc is not on PATH or torch's C++ headers are missing. The compilations (one nvcc per
file, every architecture per nvcc, float16 at every head dim and bfloat16 at 64 and 128:
tests/csrc_objects.py, whose objects tests/audit/test_audit_cuda.py audits too) start in the
background when collection ends (tests/background.py, ``prebuild``) and this module runs near the
end of a session, so they overlap the other modules' tests; its emulation tests run while nvcc
finishes. ``SSA_FLASH_COMPILE_ARCHS`` (e.g. ``"75 80 90a"``) selects other architectures.
"""
from __future__ import annotations

import math
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension

import background
import csrc_objects
from attn_testing import rotating_modes

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
TOOLS = ROOT / "tools"  # nvrtc_build.py, sass_count.py
CU_FILES = csrc_objects.CU_FILES
NVCC = shutil.which("nvcc")
ARCHS = csrc_objects.ARCHS
TIMEOUT_S = 900
# sm_70 (NVRTC, one build per head dim): 64 (with the soft-capping / sink instances), 128 and 256
# (the head dims with known sm_70 spills, below). 32 and 96 only change tile constants of the same
# templates on this path and are compiled for sm_75 / sm_80 / sm_90a by nvcc; their two NVRTC builds
# were ~4 CPU-minutes of CI.
NVRTC_HEAD_DIMS = (64, 128, 256)
# every .cu file without the soft-capping / sink instances, and those instances apart (csrc_objects)
CU_UNITS = [cu.name for cu in CU_FILES] + csrc_objects.EXTRAS_UNITS


def _torch_includes():
    paths = [Path(p) for p in cpp_extension.include_paths()]
    return paths if any((p / "ATen" / "ATen.h").is_file() for p in paths) else None


TORCH_INCLUDES = _torch_includes()

pytestmark = [
    pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH"),
    pytest.mark.skipif(TORCH_INCLUDES is None, reason="torch's C++ headers are not installed"),
]


def _nvcc(args, cwd=CSRC):
    start = time.monotonic()
    proc = subprocess.run([NVCC, *args], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def _nvrtc_sm70(out_dir, head_dim):
    """(rc, output, seconds) of tools/nvrtc_build.py for sm_70 and one head dim, or None
    when the CUDA 12 wheels are not installed."""
    tool = TOOLS / "nvrtc_build.py"
    check = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import nvrtc_build; "
                            "print(nvrtc_build.missing_reason() or '')", str(tool.parent)],
                           capture_output=True, text=True)
    if check.returncode != 0 or check.stdout.strip():
        return None
    start = time.monotonic()
    # the instances with soft-capping and sinks at one head dim (the sm_70 tanh)
    extras = ["--extras-head-dim", str(head_dim)] if head_dim == 64 else []
    proc = subprocess.run([sys.executable, str(tool), "--arch", "70", "--head-dim", str(head_dim), *extras, "--out", str(out_dir)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def _spills(output: str):
    """Kernels of ours that ptxas -v reports spilling: ['kernel (arch): N bytes', ...]."""
    found, kernel = [], None
    for line in output.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line)
        if m:
            kernel = f"{m.group(1)} ({m.group(2)})"
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and kernel and "ssa_flash" in kernel and (int(m.group(1)) or int(m.group(2))):
            found.append(f"{kernel}: {m.group(1)} bytes spill stores, {m.group(2)} bytes spill loads")
    return found


def _own_warnings(output: str):
    """Compiler warnings that point into csrc/ (toolkit and torch headers are not ours)."""
    return [line for line in output.splitlines()
            if "warning" in line.lower() and re.search(r"(^|/)csrc/|^\w+\.(cu|h|cpp)\(", line)]


def _binding_args(out_path):
    python_include = sysconfig.get_paths().get("include")
    if not python_include or not (Path(python_include) / "Python.h").is_file():
        return None
    args = ["-c", "-x", "c++", f"-std={csrc_objects.cxx_std()}", "-O0", "-I", str(CSRC), "-I", python_include,
            "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H",
            "-Xcompiler", "-Wall", "-Xcompiler", "-Wno-unused-function"]
    for inc in TORCH_INCLUDES:
        args += ["-I", str(inc)]
    return [*args, "api.cpp", "-o", str(out_path)]


def _build_emulator(dir_name, **kw):
    out_dir = background.tmpdir(dir_name)
    harness = _emu_harness()
    if harness.cuda_include_dir() is None:
        return None, "CUDA headers (cuda_fp16.h) not found"
    try:
        return (harness, harness.build(out_dir, **kw)), None
    except Exception as err:  # reported by the emulation tests
        return None, f"{type(err).__name__}: {err}"


# --- background builds (tests/background.py; tests/conftest.py calls prebuild after collection) ---
def _job_table():
    """Every compilation of this module, name -> (function, args, kwargs): the CPU emulators
    (first: the emulation tests need them first and run while nvcc works), the .cu files (one
    nvcc each, every architecture: csrc_objects; the backward files, slowest, first), the sm_70
    NVRTC builds, the binding."""
    # without the soft-capping / sink instances (a third of the build time): this module's tests
    # do not use them; tests/cuda/test_cuda_sinks_softcap.py runs emulation.py's build, which has them
    table = {"emulator": (_build_emulator, ("emu",), dict(extras=False)),
             "emulator_sm75": (_build_emulator, ("emu75",), dict(head_dims=(64, 128), sm75=True, extras=False)),
             "emulator_sm70": (_build_emulator, ("emu70",), dict(head_dims=(64, 128, 256), sm70=True, extras=False)),
             "emulator_sm90": (_build_emulator, ("emu90",), dict(head_dims=(64, 128), sm90=True, extras=False))}
    for name in sorted([cu.name for cu in CU_FILES] + csrc_objects.EXTRAS_UNITS + csrc_objects.HOPPER_UNITS,
                       key=lambda n: not n.startswith("bwd")):
        table[name] = None  # csrc_objects.submit
    # sm_70 through the CUDA 12.9 wheels (NVRTC + ptxas), one process per head dim
    for d in NVRTC_HEAD_DIMS:
        table[f"nvrtc_sm70_d{d}"] = (_nvrtc_sm70_in, (f"nvrtc_d{d}", d), {})
    binding = _binding_args(Path("api.o"))
    table["api.cpp"] = (_nvcc_to, ("binding", binding[:-1], "api.o"), {}) if binding else None
    return table


def _nvcc_to(dir_name, args, out_name):
    return _nvcc([*args, str(background.tmpdir(dir_name) / out_name)])


def _nvrtc_sm70_in(dir_name, head_dim):
    return _nvrtc_sm70(background.tmpdir(dir_name) / "out", head_dim)


def _submit(name):
    if name.endswith(".cu") or name in csrc_objects.EXTRAS_UNITS or name in csrc_objects.HOPPER_UNITS:
        return csrc_objects.submit(name)
    entry = _job_table()[name]
    return None if entry is None else background.submit(f"csrc.{name}", entry[0], *entry[1], **entry[2])


def prebuild(items):
    """Starts the builds the selected tests need (tests/background.py)."""
    if NVCC is None or TORCH_INCLUDES is None:
        return
    names = []
    for item in items:
        names += [f.replace("emu_lib", "emulator") for f in item.fixturenames if f.startswith("emu_lib")]
        if "cu_results" in item.fixturenames:
            names += CU_UNITS
        if item.originalname == "test_sm70_compiles_with_cuda12_wheels":
            names.append(f"nvrtc_sm70_d{item.callspec.params['head_dim']}")
        if item.originalname == "test_hopper_units_compile":
            names.append(item.callspec.params["name"])
        if item.originalname == "test_binding_compiles":
            names.append("api.cpp")
    for name in _job_table():  # in the table's order
        if name in names:
            _submit(name)


class _Jobs:
    """name -> the background job of that compilation (started when first asked for)."""

    def __getitem__(self, name):
        return _submit(name)


@pytest.fixture(scope="module")
def jobs():
    return _Jobs()
# --- end of background builds ---


@pytest.fixture(scope="module")
def cu_results(jobs):
    return {name: jobs[name].result() for name in CU_UNITS}


# --------------------------------------------------------------------------------------------
# The kernels run on the CPU: csrc/emu emulates threads (fibers), barriers, shuffles, ldmatrix,
# mma.sync and cp.async from their PTX definitions, and runs the real kernels and launch code.
# Checked like the GPU tests: FlashAttention's error rule against the float64 reference, plus
# bitwise-identical results under different thread schedules and cp.async completion orders
# (which a data race or a missing wait would break).

def _emu_harness():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ssa_emu_harness", ROOT / "tests" / "emu_harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _import_testing():
    try:
        import ssa_flash  # noqa: F401 (importable as installed, else from the checkout)
    except ImportError:
        sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import attn_testing
    from ssa_flash import reference

    return attn_testing, reference


@pytest.fixture(scope="module")
def emu_lib(jobs):
    return _emu_built(jobs, "emulator")


@pytest.fixture(scope="module")
def emu_lib_sm75(jobs):
    return _emu_built(jobs, "emulator_sm75")


@pytest.fixture(scope="module")
def emu_lib_sm70(jobs):
    return _emu_built(jobs, "emulator_sm70")


@pytest.fixture(scope="module")
def emu_lib_sm90(jobs):
    return _emu_built(jobs, "emulator_sm90")


def _emu_built(jobs, name):
    built, why = jobs[name].result()
    if built is None:
        if why.startswith("CUDA headers"):
            pytest.skip(why)
        pytest.fail(f"the CPU emulator did not build: {why}")
    return built


def _ref_run(reference, call, mode, q, k, v, b, n, dout, dlse, mask, causal, gqa, scale=None, drop=None,
             window=(-1, -1)):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if b is not None:
        b, n = b.detach().requires_grad_(), n.detach().requires_grad_()
    kw = {} if drop is None else dict(dropout_p=drop[0], dropout_mask=drop[1])
    if tuple(window) != (-1, -1):
        kw["window_size"] = tuple(window)
    out, lse = call(reference, mode, q, k, v, b, n, attn_mask=mask, is_causal=causal, enable_gqa=gqa,
                    return_lse=True, scale=scale, **kw)
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0).double() * dlse.double()).sum()
    inputs = [q, k, v] + ([b, n] if b is not None else [])
    grads = torch.autograd.grad(loss, inputs)
    res = dict(out=out.detach(), lse=lse.detach(), dq=grads[0], dk=grads[1], dv=grads[2])
    if b is not None:
        res.update(db=grads[3], dn=grads[4])
    return res


def _emu_case(emu_lib, mode, *, B=1, Hq=2, Hkv=None, Lq=70, Lk=None, D=64, Dv=None, dtype=torch.float16,
              causal=False, mask=None, with_dlse=False, lazy=False, seed=1, transpose=False, n_value=None,
              scale=None, key_ramp=None, deterministic=False, dropout_p=0.0, drop_seed=(2**40 + 7, 3),
              window=(-1, -1)):
    """``key_ramp``: per 64-key block, a multiple of a common direction added to the keys (and half
    of it to every query), so that the row max of the logits jumps from block to block by chosen
    amounts (the forward's conditional rescaling). ``dropout_p``: with the Philox (seed, offset)
    ``drop_seed``; the reference gets the mask ``ssa_flash.reference.dropout_keep_mask`` gives.
    ``window``: window_size (left, right), -1 unbounded."""
    harness, lib = emu_lib
    at, reference = _import_testing()
    Hkv, Lk, Dv = Hkv or Hq, Lk or Lq, Dv or D
    g = torch.Generator().manual_seed(0)
    if transpose:  # (B, L, H, D) storage, as model code produces
        q = torch.randn(B, Lq, Hq, D, generator=g, dtype=torch.float64).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, Lq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64)
    if key_ramp is not None:
        ramp = torch.tensor(key_ramp, dtype=torch.float64).repeat_interleave(64)[:Lk]
        ramp = torch.cat([ramp, ramp[-1:].expand(Lk - ramp.numel())])
        q, k = 0.3 * q + 0.5, 0.3 * k + ramp[:, None]
    q, k = q.to(dtype), k.to(dtype)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g, dtype=torch.float64).to(dtype)
    dout = torch.randn(B, Hq, Lq, Dv, generator=g, dtype=torch.float64).to(dtype)
    dlse = torch.randn(B, Hq, Lq, generator=g) if with_dlse else None
    b = n = None
    if "ssa" in mode:
        b, n = (t.detach() for t in at.head_params(Hq, device="cpu"))
        if n_value is not None:
            n = torch.as_tensor(n_value, dtype=n.dtype).expand(Hq).clone()
    emu = harness.Emulator(lib, lazy_copies=lazy, seed=seed)
    full_mask = None if mask is None else mask.expand(B, Hq, Lq, Lk)
    drop = rng = None
    if dropout_p > 0:
        rng = torch.tensor(drop_seed, dtype=torch.int64)
        drop = (dropout_p, reference.dropout_keep_mask(*drop_seed, (B, Hq, Lq, Lk), dropout_p))
    ours = emu.attention(q, k, v, mask=full_mask, b=b, n=n, causal=causal, group=Hq // Hkv,
                         adaptive="adaptive" in mode, dout=dout, dlse=dlse, scale=scale,
                         deterministic=deterministic, dropout_p=dropout_p, dropout_rng=rng, window_size=window)
    return ours, (q, k, v, b, n, dout, dlse, mask, causal, Hq != Hkv, scale, drop, window)


def _emu_check(emu_lib, mode, **kw):
    at, reference = _import_testing()
    ours, (q, k, v, b, n, dout, dlse, mask, causal, gqa, scale, drop, window) = _emu_case(emu_lib, mode, **kw)
    naive = _ref_run(reference, at.call, mode, q, k, v, b, n, dout, dlse, mask, causal, gqa, scale, drop, window)
    d64 = lambda t: None if t is None else t.double()  # noqa: E731
    gmask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    gold = _ref_run(reference, at.call, mode, d64(q), d64(k), d64(v), d64(b), d64(n), dout, dlse, gmask, causal, gqa,
                    scale, drop, window)
    floor = at.FLOORS[q.dtype]
    finite = torch.isfinite(gold["lse"])
    assert torch.equal(torch.isfinite(ours["lse"]), finite), "lse: -inf exactly on the rows with no admissible key"
    for name in ["out", "lse", "dq", "dk", "dv"] + (["db", "dn"] if b is not None else []):
        o, nv, gd = ours[name], naive[name], gold[name]
        if name == "lse":
            o, nv, gd = o[finite], nv[finite], gd[finite]
        assert torch.isfinite(o).all(), f"{name} has non-finite entries"
        fl = floor * (math.sqrt(q.shape[-2] * k.shape[-2]) if name in ("db", "dn") else (1 if name in ("out", "lse") else 4))
        at.fa_tolerance_check(name, o, nv, gd, fl)
    return ours


MODES = ["softmax", "ssa", "adaptive", "ssa_adaptive"]
SCORES = ("softmax", "ssa", "logit_scale")  # the score functions the kernels implement (csrc/logits.h)


@pytest.mark.parametrize("mode", MODES)
def test_emulated_gqa_causal_bool_mask(emu_lib, mode):
    mask = torch.rand(2, 1, 77, 130, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[:, :, 5] = False  # a row with no admissible key
    _emu_check(emu_lib, mode, B=2, Hq=4, Hkv=2, Lq=77, Lk=130, D=64, causal=True, mask=mask,
               with_dlse=True, lazy=True)


@pytest.mark.parametrize("mode", MODES)
def test_emulated_float_mask_odd_dims(emu_lib, mode):
    mask = torch.randn(1, 1, 66, 80, generator=torch.Generator().manual_seed(2))
    mask[:, :, ::9] = float("-inf")
    mask[:, :, 3, 7:] = float("-inf")
    _emu_check(emu_lib, mode, B=2, Lq=66, Lk=80, D=59, Dv=40, mask=mask, transpose=True)


# head dims and lengths: each corner with two variants (one of softmax scores, one of SSA's; the
# corner's code is the variants' shared code), as tests/triton's in-depth files do; every variant
# runs every feature on the emulator in tests/cuda/test_cuda_features.py
@pytest.mark.parametrize("mode,D,dtype", rotating_modes([(128, torch.bfloat16), (256, torch.float16),
                                                         (96, torch.float16)]))
def test_emulated_head_dims(emu_lib, mode, D, dtype):
    _emu_check(emu_lib, mode, Hq=2, Hkv=1, Lq=65, Lk=64, D=D, dtype=dtype, causal=True, lazy=D != 96)


@pytest.mark.parametrize("mode,D,dtype", rotating_modes([(128, torch.bfloat16), (96, torch.float16)]))
def test_emulated_fused_wide_heads(emu_lib, mode, D, dtype):
    """The fused backward above D = 64 (its dQ GEMM a rolled loop over column chunks: two of 32
    at D = 128, three of 16 at D = 96): interior query-block steps, GQA (two heads per key/value
    head), ragged ends, the LSE gradient."""
    _emu_check(emu_lib, mode, B=1, Hq=4, Hkv=2, Lq=100, Lk=150, D=D, dtype=dtype, with_dlse=True, lazy=True)


def _random_case(rng: random.Random, index: int) -> tuple:
    """A random call of the emulated backend: head dims around every compiled one (zero-padded
    up), separate value dims, GQA, ragged lengths, causal, boolean / float / per-head masks with
    fully masked rows, (B, L, H, D) storage, dlse, either copy mode, either backward."""
    d = rng.choice([32, 64, 96, 128, 256])
    d = rng.choice([d, d - rng.randint(1, 15)])
    dv = rng.choice([d, max(8, d - rng.randint(1, 30))])
    hkv = rng.choice([1, 2])
    hq = hkv * rng.choice([1, 2, 3])
    lq = rng.randint(1, 200)
    lk = rng.choice([lq, rng.randint(1, 260)])
    gen = torch.Generator().manual_seed(index)
    mask, r = None, rng.random()
    if r < 0.2:
        mask = torch.rand(1, 1, lq, lk, generator=gen) > 0.3
    elif r < 0.35:
        mask = torch.randn(1, rng.choice([1, hq]), lq, lk, generator=gen)
        mask[..., ::7, :] = float("-inf")
    kw = dict(B=rng.choice([1, 2]), Hq=hq, Hkv=hkv, Lq=lq, Lk=lk, D=d, Dv=dv,
              dtype=rng.choice([torch.float16, torch.bfloat16]), causal=rng.random() < 0.4, mask=mask,
              with_dlse=rng.random() < 0.5, lazy=rng.random() < 0.5, seed=index,
              transpose=rng.random() < 0.3, deterministic=rng.random() < 0.2)
    return rng.choice(MODES), kw


@pytest.mark.parametrize("chunk", range(2))
def test_emulated_random_cases(emu_lib, chunk):
    """24 seeded random calls per chunk against the float64 reference (_random_case); a failure
    names the case. (600 such cases, and 300 each on the sm_75 and sm_70 emulations, passed when
    this was written; one such run found the lazy-copy modelling error of those paths. CI runs two
    chunks, ~30 CPU-seconds less than four; ``range(N)`` here runs more.)"""
    rng = random.Random(1000 + chunk)
    for i in range(24):
        mode, kw = _random_case(rng, 100 * chunk + i)
        try:
            _emu_check(emu_lib, mode, **kw)
        except AssertionError as err:
            shown = {k: tuple(v.shape) if torch.is_tensor(v) else v for k, v in kw.items()}
            raise AssertionError(f"case {i} of chunk {chunk}: {mode} {shown}: {err}") from err


@pytest.mark.parametrize("mode,Lq,Lk", rotating_modes([(1, 1), (1, 90), (90, 1)]))
def test_emulated_lengths(emu_lib, mode, Lq, Lk):
    _emu_check(emu_lib, mode, Lq=Lq, Lk=Lk, D=32, causal=Lq > 1, transpose=True)


@pytest.mark.parametrize("mode", MODES)
def test_emulated_half_mask_wide_values(emu_lib, mode):
    """A float16 additive mask broadcast over heads and queries (converted on its compact shape),
    a value head dim larger than the key one, causal with more queries than keys."""
    mask = torch.randn(2, 1, 1, 50, generator=torch.Generator().manual_seed(4)).half()
    _emu_check(emu_lib, mode, B=2, Hq=2, Lq=140, Lk=50, D=32, Dv=72, causal=True, mask=mask)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("D", [64, 128])
def test_emulated_sm75_path(emu_lib_sm75, mode, D):
    """The Turing code path: fp16 m16n8k16 as two m16n8k8, copies synchronous (eager)."""
    mask = torch.rand(1, 1, 77, 100, generator=torch.Generator().manual_seed(6)) > 0.2
    _emu_check(emu_lib_sm75, mode, B=1, Hq=4, Hkv=2, Lq=77, Lk=100, D=D, causal=True, mask=mask,
               with_dlse=True, lazy=False, dropout_p=0.2 if D == 64 else 0.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_emulated_sm70_path(emu_lib_sm70, mode, D):
    """The Volta code path: mma.m8n8k4 (emulated from the PTX ISA's quad-pair fragment layout),
    its accumulator layout, P / dS through per-warp shared memory, synchronous copies; a window."""
    mask = torch.rand(1, 1, 77, 100, generator=torch.Generator().manual_seed(7)) > 0.2
    _emu_check(emu_lib_sm70, mode, B=1, Hq=4, Hkv=2, Lq=77, Lk=100, D=D, causal=True, mask=mask,
               with_dlse=True, lazy=False)
    # interior (unmasked) key blocks, several query blocks, odd head dim; dropout (sm_70's
    # accumulator rows are 2 apart: the per-score Philox path)
    _emu_check(emu_lib_sm70, mode, B=1, Hq=2, Lq=150, Lk=200, D=D - 5, dropout_p=0.3 if D == 64 else 0.0)
    if D == 64:  # a window (the band's blocks only, from an odd first block)
        _emu_check(emu_lib_sm70, mode, B=1, Hq=2, Lq=200, Lk=260, D=D, window=(90, 40), with_dlse=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("D", [64, 128])
def test_emulated_sm90_path(emu_lib_sm90, mode, D):
    """The sm_90a code path: every kernel's GEMMs as wgmma on 128-byte-swizzled tiles (emulated
    from the PTX ISA's register fragments, descriptor format and canonical layouts, the
    shared-memory window not 1024-byte aligned), wgmma completing at its wait (lazy) or at issue:
    forward and statistics, the fused backward (S^T, dP^T, dV, dK; its dQ mma.sync from the
    swizzled K) and the two-kernel one (dQ kernel, dK/dV kernel). Odd head dims pad to 64 / 128."""
    harness, lib = emu_lib_sm90
    before = harness.Emulator(lib).wgmma_issued()
    mask = torch.rand(2, 1, 77, 130, generator=torch.Generator().manual_seed(8)) > 0.3
    mask[:, :, 5] = False
    for deterministic, dtype, lazy in ((False, torch.bfloat16, True), (True, torch.float16, False)):
        _emu_check(emu_lib_sm90, mode, B=2, Hq=4, Hkv=2, Lq=77, Lk=130, D=D, causal=True, mask=mask,
                   with_dlse=True, lazy=lazy, deterministic=deterministic, dtype=dtype)
        _emu_check(emu_lib_sm90, mode, B=1, Hq=2, Lq=150, Lk=200, D=D - 5, lazy=not lazy,
                   deterministic=deterministic, dropout_p=0.25 if deterministic else 0.0)
    if D == 64:  # a window (the band's blocks only, from an odd first block)
        _emu_check(emu_lib_sm90, mode, B=1, Hq=2, Lq=200, Lk=260, D=D, window=(90, 40), with_dlse=True)
    assert harness.Emulator(lib).wgmma_issued() > before, "the sm_90a emulation ran no wgmma"


def _logit_scale_tests():
    """tests/cuda/test_cuda_logit_scale.py (its torch lines and case runner) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ssa_logit_scale_tests", Path(__file__).with_name("test_cuda_logit_scale.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("path", ["sm90", "sm75", "sm70"])
def test_emulated_logit_scale_paths(request, path):
    """The logit scale (csrc/logits.h, LogitScale) on the sm_90a (wgmma), sm_75 and sm_70 code
    paths at D = 64: causal, a boolean mask, GQA, fixed (fused backward) and adaptive temperature
    (two-kernel backward), against the torch lines of tests/cuda/test_cuda_logit_scale.py, which
    runs every feature on the sm_80 path."""
    harness, lib = request.getfixturevalue(f"emu_lib_{path}")
    ls = _logit_scale_tests()
    emu = harness.Emulator(lib, lazy_copies=True)
    before = emu.wgmma_issued()
    for adaptive in (False, True):
        ls._case(emu, D=64, causal=True, mask=ls._bool_mask(70, 90), adaptive=adaptive, deterministic=adaptive)
    if path == "sm90":
        assert emu.wgmma_issued() > before, "the sm_90a emulation ran no wgmma"


def test_emulated_sm90_schedule_independent(emu_lib, emu_lib_sm90):
    """sm_90a: other thread and block orders, cp.async and wgmma completing at issue or at their
    waits, give bitwise the same results (the deterministic backward); the default emulation
    (sm_80) issues no wgmma."""
    kw = dict(B=1, Hq=2, Hkv=1, Lq=90, Lk=150, D=64, causal=True, with_dlse=True, deterministic=True)
    first, _ = _emu_case(emu_lib_sm90, "ssa_adaptive", lazy=False, seed=1, **kw)
    second, _ = _emu_case(emu_lib_sm90, "ssa_adaptive", lazy=True, seed=12345, **kw)
    for name, value in first.items():
        assert torch.equal(value, second[name]), f"sm_90a: {name} depends on the schedule"
    # (the count is process-wide: the emulator libraries share their inline functions' statics)
    harness, lib = emu_lib
    before = harness.Emulator(lib).wgmma_issued()
    _emu_case(emu_lib, "softmax", **kw)
    assert harness.Emulator(lib).wgmma_issued() == before


@pytest.mark.parametrize("mode", MODES)
def test_emulated_dropout(emu_lib, mode):
    """Dropout (the kernels' Philox bits, the mask ssa_flash.reference.dropout_keep_mask defines, so
    the Triton and reference backends' too) against the reference given that mask: GQA, causal, a
    boolean mask with an empty row, dlse, both copy modes, the backward on the two-kernel path
    (the plan's, deterministic or not); p = 1 (nothing kept: outputs 0, finite gradients)."""
    mask = torch.rand(2, 1, 77, 130, generator=torch.Generator().manual_seed(9)) > 0.3
    mask[:, :, 5] = False
    for deterministic in (False, True):
        _emu_check(emu_lib, mode, B=2, Hq=4, Hkv=2, Lq=77, Lk=130, D=64, causal=True, mask=mask,
                   with_dlse=True, lazy=not deterministic, deterministic=deterministic, dropout_p=0.3)
    _emu_check(emu_lib, mode, B=1, Hq=2, Lq=150, Lk=200, D=123, dtype=torch.bfloat16, dropout_p=0.6,
               drop_seed=(12345, 2**33 + 5))
    ours = _emu_check(emu_lib, mode, B=1, Hq=2, Lq=40, Lk=70, D=32, with_dlse=True, dropout_p=1.0)
    assert torch.equal(ours["out"], torch.zeros_like(ours["out"]))


def test_emulated_dropout_mask_is_the_seeds(emu_lib):
    """The check above has teeth: the reference run with another seed's mask disagrees with the
    emulated output (so the kernels apply that seed's mask, not merely some mask)."""
    ours, (q, k, v, b, n, dout, dlse, mask, causal, gqa, scale, drop, _) = _emu_case(
        emu_lib, "softmax", B=1, Hq=2, Lq=70, Lk=90, D=64, dropout_p=0.3)
    at, reference = _import_testing()
    other = (0.3, reference.dropout_keep_mask(2**40 + 8, 3, (1, 2, 70, 90), 0.3))
    d64 = lambda t: t.double()  # noqa: E731
    same = _ref_run(reference, at.call, "softmax", d64(q), d64(k), d64(v), None, None, dout, None, None, False, False,
                    None, drop)
    wrong = _ref_run(reference, at.call, "softmax", d64(q), d64(k), d64(v), None, None, dout, None, None, False, False,
                     None, other)
    assert (ours["out"].double() - same["out"]).abs().max() < 1e-2
    assert (ours["out"].double() - wrong["out"]).abs().max() > 0.1


@pytest.mark.parametrize("mode", MODES)
def test_emulated_windows(emu_lib, mode):
    """Local windows (window_size): the forward, statistics and dQ kernels start at the band's
    first key block (K double-buffered from there: odd first blocks too), the key-block kernels at
    its first query block; with causality, a mask (an empty row), GQA, dlse, dropout; query blocks
    the band leaves no key (rows past Lk with a (0, 0) window: output 0, lse -inf) and key blocks it
    leaves no query (dK, dV 0); the backward on the two-kernel path (deterministic or not), and
    fused where the band is causality's own (a right bound under causal)."""
    mask = torch.rand(1, 1, 300, 290, generator=torch.Generator().manual_seed(11)) > 0.2
    mask[:, :, 7] = False
    _emu_check(emu_lib, mode, B=1, Hq=4, Hkv=2, Lq=300, Lk=290, D=64, mask=mask, window=(70, 9),
               with_dlse=True, lazy=True)
    _emu_check(emu_lib, mode, B=1, Hq=2, Lq=260, Lk=330, D=40, causal=True, window=(100, -1),
               deterministic=True, dropout_p=0.25)
    _emu_check(emu_lib, mode, B=1, Hq=2, Lq=200, Lk=150, D=32, window=(-1, 3), with_dlse=True)
    ours = _emu_check(emu_lib, mode, B=1, Hq=2, Lq=330, Lk=100, D=64, window=(0, 0))
    assert torch.equal(ours["out"][:, :, 100:], torch.zeros_like(ours["out"][:, :, 100:]))
    ours = _emu_check(emu_lib, mode, B=1, Hq=2, Lq=60, Lk=270, D=64, window=(5, 0), deterministic=True)
    assert torch.equal(ours["dk"][:, :, 128:], torch.zeros_like(ours["dk"][:, :, 128:]))
    _emu_check(emu_lib, mode, B=1, Hq=2, Lq=90, Lk=100, D=64, causal=True, window=(-1, 5))


# Windows wide enough for interior blocks (tile.h key_blocks: interior first, then the right
# edge's checked blocks, then the left edge's). With D = 64 (forward 128 x 64 tiles, dQ 64 x 64):
# (300, 200) over 700 keys gives the query tile at row 256 interior key blocks 2-6, the right edge
# 7-9 and the left edge 0-1; (200, -1) over 512 keys gives it interior blocks 3-7 that reach the
# last key, so the last one runs checked (TileStream cannot prefetch the wrapped-to block 0);
# causal (250, -1) at D = 128 (32-key blocks): interior blocks between the left edge and the
# diagonal. The key-block kernels see the same bands from the other side (interior query blocks
# between the right edge's and the left edge's).
WIDE_WINDOWS = [dict(Lq=700, Lk=700, D=64, window=(300, 200), Hq=4, Hkv=2, with_dlse=True),
                dict(Lq=512, Lk=512, D=64, window=(200, -1), Hq=2, lazy=True),
                dict(Lq=640, Lk=600, D=128, window=(250, -1), Hq=2, causal=True, deterministic=True)]


# The block order of a window is the variants' common code: softmax (no logit transform, one
# pass) and SSA + adaptive (the transform, the statistics kernel, the adaptive backward) take
# every kernel through it; the other two variants combine the same switches (each covered with
# windows by test_emulated_windows).
WINDOW_MODES = ["softmax", "ssa_adaptive"]


@pytest.mark.parametrize("mode", WINDOW_MODES)
@pytest.mark.parametrize("case", range(len(WIDE_WINDOWS)))
def test_emulated_wide_windows(emu_lib, mode, case):
    """Windowed calls run their interior blocks unchecked, in the rotated order (sm_80 path)."""
    _emu_check(emu_lib, mode, B=1, **WIDE_WINDOWS[case])


@pytest.mark.parametrize("mode", WINDOW_MODES)
def test_emulated_wide_windows_sm90_sm70(emu_lib_sm90, emu_lib_sm70, mode):
    """The same on the wgmma (sm_90a) and the synchronous-copy (sm_70) code paths."""
    _emu_check(emu_lib_sm90, mode, B=1, **WIDE_WINDOWS[0])
    _emu_check(emu_lib_sm90, mode, B=1, **WIDE_WINDOWS[2])
    _emu_check(emu_lib_sm70, mode, B=1, **WIDE_WINDOWS[1])


@pytest.mark.parametrize("mode", ["ssa", "ssa_adaptive"])
@pytest.mark.parametrize("causal", [False, True])
def test_emulated_ssa_n_zero(emu_lib, mode, causal):
    """n = 0: SSA weights are uniform over the admissible keys; gradients (dn included, which
    must not divide by n) are finite and match the reference."""
    ours = _emu_check(emu_lib, mode, B=1, Hq=2, Lq=140, Lk=150, D=64, causal=causal, n_value=0.0,
                      with_dlse=True)
    if not causal:
        _, (q, k, v, *_rest) = _emu_case(emu_lib, mode, B=1, Hq=2, Lq=140, Lk=150, D=64, n_value=0.0)
        uniform = v.double().mean(dim=2, keepdim=True).expand(-1, -1, q.shape[2], -1)
        torch.testing.assert_close(ours["out"].double(), uniform, atol=2e-3, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_emulated_negative_scale(emu_lib, mode):
    """A negative scale (the kernels take |scale| on -q, as the binding does)."""
    _emu_check(emu_lib, mode, B=1, Hq=2, Lq=140, Lk=150, D=32, causal=True, scale=-0.3, with_dlse=True)


@pytest.mark.parametrize("mode", ["softmax", "ssa"])
def test_emulated_interior_blocks_many(emu_lib, mode):
    """Long enough for several interior key blocks in every kernel (non-causal and causal), the
    checked loop only on the diagonal and the ragged end."""
    _emu_check(emu_lib, mode, B=1, Hq=2, Hkv=1, Lq=300, Lk=330, D=32, causal=False, lazy=True)
    _emu_check(emu_lib, mode, B=1, Hq=2, Hkv=1, Lq=300, Lk=330, D=32, causal=True, lazy=True)


@pytest.mark.parametrize("mode", MODES)
def test_emulated_growing_row_max(emu_lib, mode):
    """Logits whose row max jumps by more than the forward's rescaling slack (8 in base 2) at
    some key blocks and not at others, so that the steady-state loop breaks out to the rescaling
    step mid-row; SSA with one head of negative n (the forward negates that head's Q tile)."""
    ramp = [0.05, 0.1, 5.0, 6.0, 500.0, 2.0] if "ssa" in mode else [0.0, 0.5, 3.0, 3.2, 6.0, 1.0]
    _emu_check(emu_lib, mode, B=1, Hq=2, Hkv=1, Lq=130, Lk=400, D=32, key_ramp=ramp, lazy=True,
               n_value=[1.5, -1.2] if "ssa" in mode else None)


@pytest.mark.parametrize("mode", MODES)
def test_emulated_schedule_independent(emu_lib, mode):
    """Other thread and block orders and cp.async completion points give bitwise the same results
    with deterministic=True (the two-kernel backward); the default (fused) backward too, except dQ,
    which it accumulates with atomics in the order the blocks run (equal within rounding)."""
    kw = dict(B=1, Hq=2, Hkv=1, Lq=90, Lk=150, D=64, causal=True, with_dlse=True)
    for deterministic in (True, False):
        first, _ = _emu_case(emu_lib, mode, lazy=False, seed=1, deterministic=deterministic, **kw)
        second, _ = _emu_case(emu_lib, mode, lazy=True, seed=12345, deterministic=deterministic, **kw)
        for name, value in first.items():
            if name == "dq" and not deterministic:
                torch.testing.assert_close(value, second[name], atol=1e-2, rtol=1e-2)
            else:
                assert torch.equal(value, second[name]), f"{name} depends on the schedule ({deterministic=})"


@pytest.mark.parametrize("path", ["sm75", "sm70"])
def test_emulated_sync_paths_schedule_independent(request, path):
    """The sm_75 / sm_70 code paths (copies through registers, no cp.async): other thread and
    block orders give bitwise the same results, and the lazy-copy mode changes nothing there
    (it models cp.async completing late, which those paths do not have)."""
    lib = request.getfixturevalue(f"emu_lib_{path}")
    kw = dict(B=1, Hq=2, Hkv=1, Lq=90, Lk=150, D=64, causal=True, with_dlse=True, deterministic=True)
    first, _ = _emu_case(lib, "ssa_adaptive", lazy=False, seed=1, **kw)
    second, _ = _emu_case(lib, "ssa_adaptive", lazy=True, seed=12345, **kw)
    for name, value in first.items():
        assert torch.equal(value, second[name]), f"{path}: {name} depends on the schedule"


def test_emulated_atomic_order_is_visible(emu_lib):
    """The emulation reorders the fused backward's dQ atomics with the schedule (blocks run in a
    shuffled order), so the bitwise check above would see a deterministic path that used them."""
    kw = dict(B=1, Hq=2, Hkv=1, Lq=90, Lk=300, D=64, with_dlse=True)
    first, _ = _emu_case(emu_lib, "softmax", seed=1, **kw)
    second, _ = _emu_case(emu_lib, "softmax", seed=2, **kw)
    assert not torch.equal(first["dq"], second["dq"])
    assert torch.equal(first["dk"], second["dk"]) and torch.equal(first["dv"], second["dv"])


def test_emulated_backward_plan(emu_lib, emu_lib_sm70):
    """Which backward runs (csrc/traits.h, bwd_fused_for): the fused kernel at head dims up to 128
    (64 on sm_70) unless deterministic=True, every variant; the two-kernel path otherwise. The
    emulated checks above therefore cover both (D <= 128: fused). The score parameters' partials
    (SSA's db / dn, the logit scale's ds): one per (key block, warp) when fused, per query block
    otherwise."""
    harness, lib = emu_lib
    emu = harness.Emulator(lib)
    for D in (24, 32, 64, 96, 128):
        for score in SCORES:
            for adaptive in (False, True):
                assert emu.plan(D, D, 100, 130, score, adaptive, False, False)["fused"], (D, score, adaptive)
                assert not emu.plan(D, D, 100, 130, score, adaptive, True, False)["fused"], (D, score, adaptive)
    for score in SCORES:
        assert not emu.plan(256, 256, 100, 130, score, False, False, False)["fused"]
    plan = emu.plan(64, 64, 100, 130, "softmax", True, False, True)
    assert plan == {"fused": 1, "num_partials": 12, "stat_rows": 128, "stat_count": 6, "accum_cols": 64,
                    "hopper": 0}
    # dropout, windows: the two-kernel path (the fused kernel has no code for them: registers)
    assert not any(emu.plan(D, D, 100, 130, score, False, False, False, unfused_features=True)["fused"]
                   for D in (32, 64, 128) for score in SCORES)
    assert emu.plan(64, 64, 100, 130, "ssa", False, True, True)["num_partials"] == 2  # (100 / 64 query blocks)
    # sm_70: the fused kernel spills above D = 64 there
    emu70 = harness.Emulator(emu_lib_sm70[1])
    assert emu70.plan(64, 64, 100, 130, "ssa", True, False, False)["fused"]
    assert not any(emu70.plan(D, D, 100, 130, "ssa", False, False, False)["fused"] for D in (96, 128))


def test_kernel_scores_match_the_policies():
    """The score functions the CUDA backend accepts (cuda_backend.KERNEL_SCORES: the whole
    registry) are those of csrc/dispatch.h's list, each policy's kId (csrc/logits.h) the
    registry's id of that name and kParams its parameter count."""
    from ssa_flash import scores
    from ssa_flash.backends import cuda_backend

    sys.path.insert(0, str(TOOLS))
    try:
        import nvrtc_build
    finally:
        sys.path.remove(str(TOOLS))
    logits = (CSRC / "logits.h").read_text()
    found = []
    for policy in nvrtc_build.score_policies():
        body = re.search(r"struct " + policy + r" \{(.*?)\n\};", logits, re.S)
        assert body, f"csrc/logits.h has no policy {policy}"
        kid = int(re.search(r"kId = (\d+);", body.group(1)).group(1))
        nparams = int(re.search(r"kParams = (\d+);", body.group(1)).group(1))
        fn = scores.get(kid)
        assert len(fn.params) == nparams, (policy, fn.name)
        assert re.sub(r"(?<!^)(?=[A-Z])", "_", policy).lower() == fn.name, (policy, fn.name)  # the naming rule
        found.append(fn.name)
    assert sorted(found) == sorted(cuda_backend.KERNEL_SCORES) == sorted(scores.SCORES)


def test_emulated_call_struct_layout(emu_lib):
    """tests/emu_harness.py's ctypes mirrors of AttnCall, Operand, BwdPlan and BwdBuffers
    (csrc/set_params.h, launch.h) against the emulator's sizeof / offsetof of each: a field added,
    removed, reordered or retyped on one side only fails here instead of misreading memory."""
    import ctypes

    harness, lib = emu_lib
    layout = harness.Emulator(lib).layout()
    mirrored = {}
    for struct in harness.MIRRORS:
        mirrored[struct.__name__] = ctypes.sizeof(struct)
        for name, _ in struct._fields_:
            mirrored[f"{struct.__name__}.{name}"] = getattr(struct, name).offset
    assert layout == mirrored


def test_emulated_call_is_checked(emu_lib):
    """The shared checks (csrc/set_params.h, check_call) run on the emulator's calls as on the
    extension's: a negative scale (the Python wrapper applies it to -q), a bad group, an unknown
    score function id, a parameter count that is not the score function's, a dropout keep threshold
    or scale out of range."""
    harness, lib = emu_lib
    emu = harness.Emulator(lib)
    q = torch.zeros(1, 2, 16, 32, dtype=torch.float16)
    s = torch.ones(2)
    # (q, k, v, mask, params, sinks, beta, score, scale, causal, group, window_left, window_right,
    #  softcap, drop_keep31, drop_scale, drop_rng)
    with pytest.raises(RuntimeError, match="scale must be finite and >= 0"):
        emu.fwd(q, q, q, None, (), None, None, 0, -0.5, False, 1, -1, -1, 0.0, 0, 0.0, None)
    with pytest.raises(RuntimeError, match="group"):
        emu.row_entropy(q, q, None, (), None, 0, 0.5, False, 2, -1, -1, 0.0)
    with pytest.raises(RuntimeError, match="unknown score function id 7"):
        emu.fwd(q, q, q, None, (), None, None, 7, 0.5, False, 1, -1, -1, 0.0, 0, 0.0, None)
    with pytest.raises(RuntimeError, match="takes 1 per-head parameters; parameter 0 missing"):
        emu.fwd(q, q, q, None, (), None, None, 2, 0.5, False, 1, -1, -1, 0.0, 0, 0.0, None)
    with pytest.raises(RuntimeError, match="takes 0 per-head parameters; parameter 0 given"):
        emu.fwd(q, q, q, None, (s,), None, None, 0, 0.5, False, 1, -1, -1, 0.0, 0, 0.0, None)
    rng = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="drop_keep31 must be in"):
        emu.fwd(q, q, q, None, (), None, None, 0, 0.5, False, 1, -1, -1, 0.0, 2**31, 1.0, rng)
    with pytest.raises(RuntimeError, match="drop_scale must be finite"):
        emu.fwd(q, q, q, None, (), None, None, 0, 0.5, False, 1, -1, -1, 0.0, 2**30, float("inf"), rng)
    o, lse = emu.fwd(q, q, q, None, (s,), None, None, 2, 0.5, False, 1, -1, -1, 0.0, 0, 0.0, None)
    assert not o.isnan().any() and not lse.isnan().any()


@pytest.mark.parametrize("mode", MODES)
def test_emulated_deterministic_path(emu_lib, mode):
    """deterministic=True: the two-kernel backward (dQ kernel, dK/dV kernel) against the reference,
    masks, causality, GQA, odd head dims."""
    mask = torch.rand(2, 1, 77, 130, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[:, :, 5] = False
    _emu_check(emu_lib, mode, B=2, Hq=4, Hkv=2, Lq=77, Lk=130, D=64, causal=True, mask=mask,
               with_dlse=True, lazy=True, deterministic=True)
    _emu_check(emu_lib, mode, B=1, Hq=2, Lq=150, Lk=200, D=123, deterministic=True)


# --------------------------------------------------------------------------------------------
# nvcc (these wait for the compilations started by the `jobs` fixture; the emulation tests above
# run while nvcc works)

def test_there_are_sources():
    assert CU_FILES, "csrc/*.cu not found"
    assert (CSRC / "api.cpp").is_file()


@pytest.mark.parametrize("name", CU_UNITS)
def test_cu_compiles(cu_results, name):
    rc, output, seconds, _ = cu_results[name]
    assert rc == 0, f"nvcc failed on {name} ({seconds:.0f}s):\n{output[-20000:]}"
    warnings = _own_warnings(output)
    assert not warnings, f"{name}: compiler warnings in csrc/:\n" + "\n".join(warnings[:50])
    spills = _spills(output)
    unknown = [sp for sp in spills if not _known_spill(sp, KNOWN_SM75_SPILLS, "sm_75")
               and not any(_known_spill(sp, known, gpu) for gpu, known in KNOWN_EXTRAS_SPILLS.items())]
    assert not unknown, f"{name}: register spills ({' '.join(ARCHS)}):\n" + "\n".join(unknown)


@pytest.mark.parametrize("name", csrc_objects.HOPPER_UNITS or ["(sm_90a not compiled)"])
def test_hopper_units_compile(jobs, name):
    """The backward unit as a build holding the sm_90a kernels compiles it (-DSSA_FLASH_HOPPER_FWD=1:
    the dispatch to the sm_90a backward, its host side, the run-time switch; csrc_objects.HOPPER_UNITS),
    for sm_90a: no errors, no warnings in csrc/, and the sm_90a backward's kernel is in it."""
    if not csrc_objects.HOPPER_UNITS:
        pytest.skip("sm_90a not compiled (SSA_FLASH_COMPILE_ARCHS)")
    rc, output, seconds, _ = jobs[name].result()
    assert rc == 0, f"nvcc failed on {name} ({seconds:.0f}s):\n{output[-20000:]}"
    warnings = _own_warnings(output)
    assert not warnings, f"{name}: compiler warnings in csrc/:\n" + "\n".join(warnings[:50])
    kernel = "hopper_bwd_kernel" if name.startswith("bwd") else "attn_fwd_ws_kernel"
    assert re.search(rf"Compiling entry function '\S*{kernel}\S*' for 'sm_90a'", output), f"{kernel} not in {name}"


def _known_spill(spill: str, known: dict, arch: str = "") -> bool:
    """Whether `spill` (a _spills line, of `arch` if given) is one of `known` (kernel name fragment
    -> byte cap), within its cap."""
    if arch and f"({arch})" not in spill:
        return False
    cap = next((c for k, c in known.items() if k in spill), None)
    return cap is not None and max(int(x) for x in re.findall(r"(\d+) bytes spill", spill)) <= cap


# Known sm_75 spills (nvcc, sm_75: synchronous copies, m16n8k8 pairs), name fragment -> byte cap.
# None today. (The float16 SSA forward at D = 128 kept 12 bytes of loop invariants on the stack
# from dropout's code until windowed calls stopped rotating their key blocks on sm_70 / sm_75,
# tile.h KeyBlocks, 2026-11-25.)

# (2026-12-01: the backward's finite-mask changes, csrc/lse_residual.h's recounted residuals read
# in the key-block kernels' checked scores, spilled 4-20 B there on sm_80 / sm_90a and 36-124 B
# on sm_70; since 2026-12-02 those kernels take the residuals through their statistics and dO
# instead, with no value more in their elementwise code, and spill no more.)

KNOWN_SM75_SPILLS: dict = {}


# Known spills of the soft-capping kernels (the fused backward at D = 128; found by this test,
# 2026-11-26; bench/NOTES.md), by GPU, name fragment -> byte cap (stores). Each is one or two
# registers of the prologue stored once and reloaded at the head of an outer loop (per head and
# pass; sm_80: per checked step), none in an interior loop (cuobjdump -sass: every STL / LDL
# against the backward branches). Strict like the others below.
KNOWN_EXTRAS_SPILLS: dict = {
    "sm_90a": {  # SSA + softcap; adaptive + softcap (again since 2026-12-02: the finite-mask
        # changes had taken its spill away, their fix brought it back); (the D = 64 dQ kernel's 4 B:
        # not compiled since the extras units are D = 128 only, tests/csrc_objects.py EXTRAS_DIMS)
        "attn_bwd_fused_kernelINS_12KernelTraitsILi128ELi32ELi64ELi4E6__halfLi1EEENS_3SsaELb0ELb1E": 4,
        "attn_bwd_fused_kernelINS_12KernelTraitsILi128ELi32ELi64ELi4E6__halfLi1EEENS_7SoftmaxELb1ELb1E": 8,
    },
    "sm_80": {  # SSA + adaptive + softcap
        "attn_bwd_fused_kernelINS_12KernelTraitsILi128ELi32ELi64ELi4E6__halfLi1EEENS_3SsaELb1ELb1E": 4,
    },
}


@pytest.mark.parametrize("gpu", sorted(KNOWN_EXTRAS_SPILLS))
def test_known_extras_spills_still_spill(cu_results, gpu):
    """Strict: a kernel listed in KNOWN_EXTRAS_SPILLS that no longer spills fails until removed."""
    if gpu[3:] not in csrc_objects.EXTRAS_ARCHS:
        pytest.skip(f"{gpu} not compiled (SSA_FLASH_COMPILE_ARCHS)")
    spills = [sp for name in cu_results for sp in _spills(cu_results[name][1]) if f"({gpu})" in sp]
    gone = [k for k in KNOWN_EXTRAS_SPILLS[gpu] if not any(k in sp for sp in spills)]
    assert not gone, f"listed in KNOWN_EXTRAS_SPILLS[{gpu!r}] but no longer spilling (remove them): {gone}"


def test_known_sm75_spills_still_spill(cu_results):
    """Strict: a kernel listed in KNOWN_SM75_SPILLS that no longer spills fails until removed."""
    spills = [sp for name in cu_results for sp in _spills(cu_results[name][1]) if "(sm_75)" in sp]
    gone = [k for k in KNOWN_SM75_SPILLS if not any(k in sp for sp in spills)]
    if "75" not in ARCHS:
        pytest.skip("sm_75 not compiled (SSA_FLASH_COMPILE_ARCHS)")
    if not KNOWN_SM75_SPILLS:
        pytest.skip("no known sm_75 spills (test_cu_compiles fails on any)")
    assert not gone, f"listed in KNOWN_SM75_SPILLS but no longer spilling (remove them): {gone}"


# Known sm_70 spills (strict: a listed kernel that stops spilling fails the test until removed),
# name fragment -> byte cap. Since the dK/dV kernel took the fused kernel's body (key-block steps
# through TileLoader offsets, 16-byte statistics copies), ptxas keeps loop-invariant state on the
# stack in these dK/dV instantiations (other layouts tried moved the spill, or made it 100+
# bytes): Volta only, issue 14. At D = 256 the SASS shows per-thread offsets into the sm_70
# per-warp scratch (row stride 40), stored in the prologue and reloaded once before the main
# loops. At D = 128 the adaptive variants: 8 bytes before dropout's code joined the checked step
# (one or two 4-byte reloads per query-block step), 20-24 since (stores in the prologue, reloads
# before the loops and in the epilogue; the flags' Philox evaluation needs registers this path
# does not have). Since windows (the band's query-block range and bounds): SSA adaptive 32 / 48
# bytes (stores in the prologue; per query-block step, 3 four-byte reloads in one step loop of
# ~2,700 instructions and 4 in the other of ~1,800), softmax adaptive 4 / 4 (cuobjdump -sass of
# tools/nvrtc_build.py's cubin, 2026-11-25). (Which instantiations spill moves with unrelated
# changes: with the head loop of csrc/bwd_kernel.h counting head indices, as the fused kernel's
# does, there were five.)
KNOWN_SM70_SPILLS = {
    128: {"attn_bwd_dkdv_kernelINS_12KernelTraitsILi128ELi32ELi64ELi4E6__halfLi1EEENS_3SsaELb1E": 48,
          "attn_bwd_dkdv_kernelINS_12KernelTraitsILi128ELi32ELi64ELi4E6__halfLi1EEENS_7SoftmaxELb1E": 4,
          # the logit scale, adaptive (its first build, NVRTC 12.9, 2026-11-28: 8 / 8, between the
          # softmax and SSA variants')
          "attn_bwd_dkdv_kernelINS_12KernelTraitsILi128ELi32ELi64ELi4E6__halfLi1EEENS_10LogitScaleELb1E": 8},
    256: {"attn_bwd_dkdv_kernelINS_12KernelTraitsILi256ELi32ELi32ELi4E6__halfLi2EEENS_3SsaELb1E": 8,
          "attn_bwd_dkdv_kernelINS_12KernelTraitsILi256ELi32ELi32ELi4E6__halfLi2EEENS_7SoftmaxELb1E": 8},
}


@pytest.mark.parametrize("head_dim", NVRTC_HEAD_DIMS)
def test_sm70_compiles_with_cuda12_wheels(jobs, head_dim):
    """The Volta (mma.m8n8k4) code path of every float16 kernel, compiled to sm_70 SASS by the
    CUDA 12.9 NVRTC and ptxas from PyPI (CUDA 13's nvcc has no sm_70): no errors, no spills
    beyond KNOWN_SM70_SPILLS (each within its byte cap)."""
    res = jobs[f"nvrtc_sm70_d{head_dim}"].result()
    if res is None:
        pytest.skip("CUDA 12 wheels (nvidia-cuda-nvrtc-cu12, -nvcc-cu12, -runtime-cu12) not installed")
    rc, output, seconds = res
    assert rc == 0, f"sm_70 build failed ({seconds:.0f}s):\n{output[-20000:]}"
    assert "mma.sync.aligned.m8n8k4" in (Path(output.split("cubin: ")[-1].strip()).with_suffix(".ptx")).read_text()
    spills = _spills(output)
    known = KNOWN_SM70_SPILLS.get(head_dim, {})
    unknown = [sp for sp in spills if not _known_spill(sp, known)]
    assert not unknown, "register spills on sm_70:\n" + "\n".join(unknown)
    gone = [k for k in known if not any(k in sp for sp in spills)]
    assert not gone, f"listed in KNOWN_SM70_SPILLS but no longer spilling (remove them): {gone}"


def test_binding_compiles(jobs):
    """api.cpp (the only file that includes torch) against torch's headers, as the host compiler
    of an extension build sees it. It includes no c10/cuda header, so CPU-only torch wheels do."""
    if jobs["api.cpp"] is None:
        pytest.skip("Python.h not found (python3-dev)")
    rc, output, seconds = jobs["api.cpp"].result()
    assert rc == 0, f"api.cpp failed to compile ({seconds:.0f}s):\n{output[-20000:]}"
    warnings = _own_warnings(output)
    assert not warnings, "compiler warnings in csrc/api.cpp:\n" + "\n".join(warnings[:50])


def test_tile_table_matches_python(tmp_path):
    """ssa_flash.cuda mirrors the shared-memory sizes of csrc/traits.h to refuse inputs a GPU
    cannot run with a clear message; the two must agree."""
    try:
        from ssa_flash import cuda
    except ImportError:  # the package is not installed: import it from the checkout
        sys.path.insert(0, str(ROOT))
        from ssa_flash import cuda

    prog = tmp_path / "traits_dump.cpp"
    prog.write_text(
        '#include <cstdio>\n#include <initializer_list>\n#include "traits.h"\nusing namespace ssa_flash;\n'
        "int main() {\n"
        "  for (int d : {32, 64, 96, 128, 256})\n"
        "    for (int a : {0, 1}) {\n"
        "      for (int v : {0, 1, 2, 3}) {\n"
        "        int m = fwd_smem_bytes(d, 2, v);\n"
        "        if (row_entropy_smem_bytes(d, 2) > m) m = row_entropy_smem_bytes(d, 2);\n"
        "        if (dq_smem_bytes(d, 2, v) > m) m = dq_smem_bytes(d, 2, v);\n"
        "        if (dkdv_smem_bytes(d, 2, a, v) > m) m = dkdv_smem_bytes(d, 2, a, v);\n"
        '        std::printf("%d %d %d %d\\n", d, a, v, m);\n'
        "      }\n"
        "    }\n}\n")
    rc, output, _ = _nvcc(["-x", "c++", "-std=c++17", "-I", str(CSRC), str(prog), "-o", str(tmp_path / "dump")],
                          cwd=tmp_path)
    assert rc == 0, output
    lines = subprocess.run([str(tmp_path / "dump")], capture_output=True, text=True, check=True).stdout.split("\n")
    for line in filter(None, lines):
        d, a, v, m = map(int, line.split())
        assert cuda._smem_bytes(d, bool(a), v) == m, f"head dim {d}, adaptive {a}, code path {v}: traits.h {m}"
        assert cuda._padded_head_dim(d) == d
    for d in (1, 8, 33, 59, 111, 129, 200, 256):
        assert cuda._padded_head_dim(d) in (32, 64, 96, 128, 256) and cuda._padded_head_dim(d) >= d
    assert cuda._padded_head_dim(257) == -1


def test_sass_count_loop_counts():
    """tools/sass_count.py's counting function on a hand-written SASS listing: the main loop
    is the innermost backward-branch loop with tensor-core instructions (ties: the smallest), and
    its instructions are counted per score element, MUFU by kind, LDSM per HMMA."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ssa_flash_sass_count", TOOLS / "sass_count.py")
    sc = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sc  # (dataclasses look their module up)
    spec.loader.exec_module(sc)
    lines = [
        "MOV R1, c[0x0][0x28]",            # 0x00
        "HMMA.16816.F32 R4, R8, R12, RZ",  # 0x10 (outside every loop)
        "LDSM.16.M88.4 R8, [R2]",          # 0x20  checked loop 0x20..0x60
        "HMMA.16816.F32 R4, R8, R12, R4",  # 0x30
        "MUFU.LG2 R5, R5",                 # 0x40
        "MUFU.EX2 R5, R5",                 # 0x50
        "@P0 BRA 0x20",                    # 0x60
        "LDSM.16.M88.4 R8, [R2]",          # 0x70  interior loop 0x70..0xa0
        "HMMA.16816.F32 R4, R8, R12, R4",  # 0x80
        "MUFU.EX2 R5, R5",                 # 0x90
        "@P1 BRA 0x70",                    # 0xa0
        "@P2 BRA 0x20",                    # 0xb0  outer loop around both: not a main loop
        "EXIT",                            # 0xc0
    ]
    sass = "\n".join(f"        /*{16 * i:04x}*/                   {text} ;" for i, text in enumerate(lines))
    spec16 = sc.LoopSpec(block_m=16, block_n=8, threads=32)
    main = sc.count_loop(sass, spec16)
    assert main["loop"] == [0x70, 0xA0]
    assert main["instructions"] == 4 and main["per_element"] == 1.0
    assert main["mufu"] == {"EX2": 1} and main["mma"] == 1 and main["ldmatrix_per_mma"] == 1.0
    checked = sc.count_loop(sass, sc.LoopSpec(block_m=16, block_n=8, threads=32, rank=1))
    assert checked["loop"] == [0x20, 0x60] and checked["instructions"] == 5
    assert checked["mufu"] == {"EX2": 1, "LG2": 1} and checked["mufu_per_element"] == 0.5
    assert sc.count_loop(sass, sc.LoopSpec(block_m=16, block_n=8, threads=32, rank=2)) is None
