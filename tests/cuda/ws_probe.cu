// tests/cuda/ws_probe.cuh compiled for the device (tests/cuda/test_pipeline_emulated.py:
// nvcc -arch=sm_90a -cubin -I csrc, then the SASS is read).
#include "ws_probe.cuh"

template __global__ void ssa_flash::ws_probe_kernel<ssa_flash::kProbeOk>(const __grid_constant__ ssa_flash::ProbeParams);
