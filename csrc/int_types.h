// Fixed-width integer types: <cstdint>, except under NVRTC (which compiles the sm_70 code path
// with CUDA 12 wheels in the tests, csrc/tools/nvrtc_build.py) where the header does not exist.
#pragma once

#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <cstdint>
#endif
