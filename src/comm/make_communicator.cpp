// The communicator factory. The native NCCL communicator (src/comm/cuda/) plugs in here: every CUDA
// build (FP8DP_WITH_CUDA) compiles it and links NCCL, and defines make_nccl_communicator().
#include "comm/make_communicator.h"

#if defined(FP8DP_WITH_CUDA) && !defined(FP8DP_CUDA_COMPILE_ONLY)
#define FP8DP_HAVE_NCCL_COMMUNICATOR 1
#endif

#include "comm/process_group_communicator.h"
#include "common/check.h"

namespace fp8dp {

#if defined(FP8DP_HAVE_NCCL_COMMUNICATOR)
std::shared_ptr<Communicator> make_nccl_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                     bool high_priority_stream);
bool native_nccl_available() { return true; }
#else
bool native_nccl_available() { return false; }
#endif

std::shared_ptr<Communicator> make_communicator(const std::string& backend,
                                                c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                bool cuda, bool high_priority_stream) {
  FP8DP_CHECK_ARG(backend == "auto" || backend == "nccl" || backend == "process_group",
                  "comm_backend: expected 'auto', 'nccl' or 'process_group', got '", backend, "'");
  FP8DP_CHECK_ARG(group, "process_group: expected a live c10d ProcessGroup, got None");
  const bool nccl = backend == "nccl" || (backend == "auto" && cuda && native_nccl_available());
  if (nccl) {
    FP8DP_CHECK_ARG(native_nccl_available(),
                    "comm_backend: 'nccl' needs fp8dp built with CUDA and NCCL; this build has no "
                    "native NCCL communicator (use 'process_group' or 'auto')");
    FP8DP_CHECK_ARG(cuda,
                    "comm_backend: 'nccl' needs the parameters on a CUDA device, they are on "
                    "the CPU");
#if defined(FP8DP_HAVE_NCCL_COMMUNICATOR)
    return make_nccl_communicator(std::move(group), high_priority_stream);
#else
    (void)high_priority_stream;
#endif
  }
  return std::make_shared<ProcessGroupCommunicator>(std::move(group));
}

}  // namespace fp8dp
