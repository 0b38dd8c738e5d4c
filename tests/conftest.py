"""Test configuration.

* Without a GPU the Triton kernels run through Triton's CPU interpreter, which must be switched on
  before anything imports triton, minus two costs that buy nothing (tests/interpreter_speedup.py).
* The fast tier, ``python -m pytest -m "not slow"``: the ``slow`` marker is given here, by the
  table below, to what the edit-test loop can leave to CI (compiles, subprocess runs, the
  interpreter's in-depth parametrisations); the feature matrix (tests/features.py: every feature
  with every variant, on the reference, the Triton kernels and the emulated CUDA kernels) and the
  unit tests stay in it. A test marked ``@pytest.mark.slow`` in its file is slow too.
* Slow build work starts as soon as collection ends (tests/background.py): each collected module
  with a ``prebuild(items)`` function is given its selected tests and starts the builds they
  need in the background; those modules run last (in the order of
  ``RUN_LAST``), so that every other module's interpreter tests run while they build. Modules
  using ``emulation.build_emulator`` get the emulator started the same way (one build for all).
* GPU runs (bench/run_gpu.sh): the guards of ``ssa_flash.bench.pytest_summary``, loaded here in
  every session: a test that meets a CUDA error (a device-side assert, an illegal address: the
  process's CUDA context is unusable afterwards) ends its process once its reports are sent, so
  that pytest-xdist starts a fresh worker instead of every later test on it failing (without
  xdist the session stops there); with ``SSA_FLASH_REQUIRE_CUDA=1`` (set once the CUDA extension
  is built) a test skipped because the CUDA backend is "unavailable" fails instead.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import background  # noqa: E402  (tests/ is on the path: pyproject.toml's pythonpath)
import emulation  # noqa: E402
import interpreter_speedup  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    interpreter_speedup.install()  # (two costs of the interpreter that buy nothing: see its docstring)

# Modules whose tests wait for background builds, in the order they run at the end of a session:
# the emulation tests first (they need only the emulators, which build first, and keep the main
# core busy while nvcc and the audits' compiles finish on the other).
# (test_audit before test_audit_cuda: its compiles fill the audit cache the latter's Triton
# variants, a subset, then read.)
RUN_LAST = ["test_csrc_compile", "test_audit", "test_audit_cuda"]


# -------------------------------------------------------------------------------------------
# The fast tier's table: what `-m "not slow"` leaves out (CI runs everything).

# whole modules: compiles (nvcc, NVRTC, the audits' Triton compiles), processes (the self-check,
# gloo ranks, the examples, the benchmark), and the in-depth files of each feature through the
# interpreter or the CUDA emulator, whose every feature path the feature matrix takes once
SLOW_MODULES = {
    "test_csrc_compile", "test_audit_cuda", "test_main", "test_distributed", "test_distributed_partial",
    "test_examples", "test_gpu_smoke", "test_transformers", "test_triton_kernels", "test_dropout",
    "test_window", "test_varlen", "test_kvcache", "test_gradcheck", "test_properties", "test_independent",
    "test_edge_cases", "test_precision", "test_fast_math", "test_triton_entropy", "test_custom_op",
    "test_backends", "test_nn", "test_cuda_backend", "test_distributed_sinks", "test_cuda_matrix",
}
# tests of the other modules that use these fixtures (a build or a compile each)
SLOW_FIXTURES = {
    "sdist",            # test_packaging: builds the sdist (and a wheel from it)
    "smoke",            # test_bench: the benchmark's CPU smoke run
    "audit_results",    # test_audit: the audit's compiles of every CI variant
    "family_results",   # test_audit: every family's first choices compiled
    "as_cpu_user",      # test_docs: the python blocks of the docs, run
}
# single tests of the other modules (subprocesses, other Tritons, the reference at length)
SLOW_TESTS = {
    "test_kernels_compile_with_other_triton", "test_probe_kernel_measured_as_known",
    "test_gpu_bench_tiny", "test_smoke_default_output_is_found_and_named_smoke",
    "test_build_ext_compiler_error_installs_pure_python", "test_cuda_section_on_a_known_kernel",
    "test_ops_gradcheck_reference_backend",
    # tests/ops/test_finite_mask_rows.py's emulated CUDA backend (the emulator's build) and
    # tests/ops/test_mask_grad.py's float64 gradchecks (a minute)
    "test_cuda_emulated", "test_gradcheck_reference",
    # the CUDA kernels' sinks and soft-capping on the emulator (the -inf sink, entropy and
    # supports tests of that module stay in the fast tier)
    "test_cuda_sinks_softcap_variants", "test_cuda_sinks_softcap_causal_masked",
    "test_cuda_sinks_softcap_float_mask_window_dropout", "test_cuda_sinks_softcap_window_dropout_alone",
    # tests/triton/test_triton_sinks_softcap.py: its fast tier is every variant with both features
    "test_matches_reference_one_feature", "test_masks_with_sinks_and_softcap", "test_dropout_and_window",
    "test_packed_batch", "test_kvcache_split_kv_decode", "test_gradcheck_with_sinks_and_softcap",
    "test_kernel_sinks_minus_inf_is_no_sink", "test_large_softcap_is_no_softcap",
    # bench/run_gpu.sh's rehearsal without a GPU (1.5-2.5 min of subprocesses on an idle 2-core machine,
    # 7 min on a third of a core: its time limits only catch hangs)
    "test_dry_run_rehearsal",
}


def _slow(item) -> bool:
    module = getattr(getattr(item, "module", None), "__name__", "")
    return (module in SLOW_MODULES or bool(SLOW_FIXTURES & set(getattr(item, "fixturenames", ())))
            or getattr(item, "originalname", None) in SLOW_TESTS)


def _waits(module) -> bool:
    return callable(getattr(module, "prebuild", None))


def _last_rank(module) -> int:
    name = module.__name__
    return RUN_LAST.index(name) if name in RUN_LAST else len(RUN_LAST)


def pytest_collection_modifyitems(session, config, items):
    import pytest

    for item in items:
        if _slow(item):
            item.add_marker(pytest.mark.slow)

    def rank(item):
        module = getattr(item, "module", None)
        return 1 + _last_rank(module) if _waits(module) else 0

    items.sort(key=rank)  # stable: collection order within each group


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    selected, emulator = {}, False
    for item in session.items:
        module = getattr(item, "module", None)
        if _waits(module):
            selected.setdefault(module, []).append(item)
        emulator = emulator or getattr(module, "build_emulator", None) is emulation.build_emulator
    # needed mid-session (ops/, gpu_smoke/): queued first; on a GPU the CUDA backend's tests run
    # the extension, and a test that still wants the emulator builds it when it asks
    if emulator and not torch.cuda.is_available():
        emulation.prebuild()
    for module in sorted(selected, key=_last_rank):
        module.prebuild(selected[module])


def pytest_sessionfinish(session, exitstatus):
    background.finish()


# -------------------------------------------------------------------------------------------
# GPU runs: ssa_flash.bench.pytest_summary's guards (a CUDA error ends the xdist worker; "CUDA
# backend unavailable" fails under SSA_FLASH_REQUIRE_CUDA=1) in every session, not only in
# bench/run_gpu.sh's (which loads the plugin with -p); its counts file is written only when
# SSA_FLASH_TESTS_JSON is set.


def pytest_configure(config):
    config.pluginmanager.import_plugin("ssa_flash.bench.pytest_summary")


@pytest.fixture(autouse=True)
def _fresh_backend_answers():
    """Backend availability is remembered per process (``ssa_flash.backends.forget``); tests
    change what the probes see (fake GPUs, patched probes), so each test starts afresh."""
    from ssa_flash import backends

    backends.forget()
    yield
    backends.forget()
