// The sm_90a warp-specialised forward (csrc/hopper/) compiled for the device
// (not part of the extension build, which compiles csrc/*.cu only: tests/cuda/test_hopper_fwd_emulated.py
// and ssa_flash/audit/hopper.py: nvcc -arch=sm_90a -cubin -DSSA_FLASH_HOPPER_FWD=1 -I csrc,
// then ptxas -v and the SASS are read; ssa_flash/audit/hopper.py counts its main loops). The
// instances the launcher ships (fwd_launch.h run_fwd_ws_hdim, MufuAll), bfloat16, and the MUFU
// budgets the static model compares, the row-entropy pass's instances, and the packed-sequence
// instances of both (bfloat16). The
// launcher's host code is compiled too (SSA_FLASH_WS_FWD_HOST).
#include "hopper/fwd_launch.h"

namespace ssa_flash {
namespace hopper {

using Ex2Quarter = MufuBudget<2, 0>;  // a quarter of ex2 on the FMA pipe
using Ex2Lg2Quarter = MufuBudget<2, 2>;  // and a quarter of lg2
using Ex2Eighth = MufuBudget<1, 0>;
using Ex2ThreeEighths = MufuBudget<3, 0>;

#define SSA_WS_FWD_INSTANCE(D, SCORE, ADAPTIVE, MUFU)                                                \
  template __global__ void attn_fwd_ws_kernel<WsFwdTraits<D, __nv_bfloat16, MUFU>, SCORE, ADAPTIVE>( \
      const __grid_constant__ HopperFwdParams);

SSA_WS_FWD_INSTANCE(64, Softmax, false, MufuAll)
SSA_WS_FWD_INSTANCE(128, Softmax, false, MufuAll)
SSA_WS_FWD_INSTANCE(64, Ssa, false, MufuAll)
SSA_WS_FWD_INSTANCE(128, Ssa, false, MufuAll)
SSA_WS_FWD_INSTANCE(128, Ssa, true, MufuAll)
SSA_WS_FWD_INSTANCE(128, LogitScale, false, MufuAll)
SSA_WS_FWD_INSTANCE(64, Ssa, false, Ex2Quarter)
SSA_WS_FWD_INSTANCE(128, Ssa, false, Ex2Quarter)
SSA_WS_FWD_INSTANCE(64, Ssa, false, Ex2Lg2Quarter)
SSA_WS_FWD_INSTANCE(64, Softmax, false, Ex2Quarter)
SSA_WS_FWD_INSTANCE(64, Softmax, false, Ex2Eighth)
SSA_WS_FWD_INSTANCE(64, Ssa, false, Ex2ThreeEighths)
SSA_WS_FWD_INSTANCE(128, Ssa, false, Ex2Eighth)

// the row-entropy pass (fwd_row_entropy.h): every score function, D 64 and 128
#define SSA_WS_ROW_ENTROPY_INSTANCE(D, SCORE)                                                     \
  template __global__ void attn_row_entropy_ws_kernel<WsRowEntropyTraits<D, __nv_bfloat16>, SCORE>( \
      const __grid_constant__ HopperFwdParams);

SSA_WS_ROW_ENTROPY_INSTANCE(64, Softmax)
SSA_WS_ROW_ENTROPY_INSTANCE(128, Softmax)
SSA_WS_ROW_ENTROPY_INSTANCE(64, Ssa)
SSA_WS_ROW_ENTROPY_INSTANCE(128, Ssa)
SSA_WS_ROW_ENTROPY_INSTANCE(64, LogitScale)
SSA_WS_ROW_ENTROPY_INSTANCE(128, LogitScale)

// packed sequences (attn_fwd_ws_varlen_kernel, attn_row_entropy_ws_varlen_kernel): the launcher's
// all-MUFU instances of every score function, fixed and adaptive temperature, D 64 and 128
#define SSA_WS_FWD_VARLEN_INSTANCE(D, SCORE, ADAPTIVE)                                                    \
  template __global__ void attn_fwd_ws_varlen_kernel<WsFwdTraits<D, __nv_bfloat16, MufuAll>, SCORE, ADAPTIVE>( \
      const __grid_constant__ HopperFwdParams);
#define SSA_WS_ROW_ENTROPY_VARLEN_INSTANCE(D, SCORE)                                                     \
  template __global__ void attn_row_entropy_ws_varlen_kernel<WsRowEntropyTraits<D, __nv_bfloat16>, SCORE>( \
      const __grid_constant__ HopperFwdParams);
#define SSA_WS_VARLEN_INSTANCES(D, SCORE)      \
  SSA_WS_FWD_VARLEN_INSTANCE(D, SCORE, false)  \
  SSA_WS_FWD_VARLEN_INSTANCE(D, SCORE, true)   \
  SSA_WS_ROW_ENTROPY_VARLEN_INSTANCE(D, SCORE)

SSA_WS_VARLEN_INSTANCES(64, Softmax)
SSA_WS_VARLEN_INSTANCES(128, Softmax)
SSA_WS_VARLEN_INSTANCES(64, Ssa)
SSA_WS_VARLEN_INSTANCES(128, Ssa)
SSA_WS_VARLEN_INSTANCES(64, LogitScale)
SSA_WS_VARLEN_INSTANCES(128, LogitScale)

#ifdef SSA_FLASH_WS_FWD_HOST
// the host side: tensor-map encoding and the launch (compiled, not run here)
template std::string run_fwd_ws<__nv_bfloat16>(const FwdParams&, int, bool, cudaStream_t);
template std::string run_row_entropy_ws<__nv_bfloat16>(const FwdParams&, int, cudaStream_t);
#endif

}  // namespace hopper
}  // namespace ssa_flash
