// build_info(): compile-time switches plus the CUDA library versions loaded at run time.
#include "common/build_info.h"

#if defined(FP8DP_WITH_CUDA)
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace fp8dp {

BuildInfo build_info() {
  BuildInfo b;
  b.version = FP8DP_VERSION;
  b.torch_version = FP8DP_TORCH_VERSION;
#if defined(FP8DP_WITH_CUDA)
  b.cuda = true;
  int rt = 0;
  if (cudaRuntimeGetVersion(&rt) == cudaSuccess) {
    b.cuda_runtime_version = std::to_string(rt / 1000) + "." + std::to_string((rt % 1000) / 10);
  }
  const size_t lt = cublasLtGetVersion();
  b.cublaslt_version = std::to_string(lt / 10000) + "." + std::to_string((lt % 10000) / 100) + "." +
                       std::to_string(lt % 100);
  int nv = 0;
  if (ncclGetVersion(&nv) == ncclSuccess) {
    b.nccl_version = std::to_string(nv / 10000) + "." + std::to_string((nv % 10000) / 100) + "." +
                     std::to_string(nv % 100);
  }
#endif
  return b;
}

}  // namespace fp8dp
