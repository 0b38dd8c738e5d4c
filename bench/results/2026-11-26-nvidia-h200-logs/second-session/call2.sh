export PYTHONPATH=$PWD; unset TRITON_INTERPRET
(timeout 215 python3 bench/gpu_diag2.py > $OUT/diag2.log 2>&1 &)
SSA_FLASH_AUTOTUNE=0 SSA_FLASH_TESTS_JSON=$OUT/suite.json timeout 205 python3 -m pytest -p ssa_flash.bench.pytest_summary -q -rfEs -p no:cacheprovider -n 14 -m "not gpu_smoke" -k "not cuda" $(grep -v '^\s*\(#\|$\)' bench/gpu_recheck.txt) tests/triton/test_gradcheck.py::test_float64_bool_mask_as_additive_is_the_same_attention tests/ops tests/nn tests/integrations tests/triton/test_triton_features.py tests/triton/test_dropout.py tests/triton/test_triton_sinks_softcap.py tests/triton/test_window.py tests/triton/test_triton_kernels.py > $OUT/suite.log 2>&1
sleep 8; tail -3 $OUT/suite.log; tail -30 $OUT/diag2.log
