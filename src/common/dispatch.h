// The one CPU-or-CUDA dispatch of the LibTorch layers: a kernel's CPU and CUDA entry points take
// the same arguments (the CUDA one a stream after them), so one call runs the one for a device.
#pragma once

#include <c10/core/Device.h>

#include "common/check.h"
#include "common/parallel_aten.h"

#if defined(FP8DP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

// The CUDA entry point to pass to dispatch_kernel: declared only in CUDA builds, so elsewhere it
// is a null pointer that dispatch_kernel never calls.
#if defined(FP8DP_WITH_CUDA)
#define FP8DP_CUDA_KERNEL(fn) (&(fn))
#else
#define FP8DP_CUDA_KERNEL(fn) nullptr
#endif

namespace fp8dp {
namespace detail {
template <typename T>
struct NoDeduce {
  using type = T;
};
}  // namespace detail

// Runs cuda(args..., stream) on a CUDA device, under a guard for that device and on its current
// stream (so the kernel is ordered with the torch work around it), else cpu(args...). The caller
// has checked the device (check_device_supported); any other device is an internal error.
template <typename... Args>
void dispatch_kernel(const c10::Device& device, void (*cpu)(Args...),
                     typename detail::NoDeduce<void (*)(Args..., void*)>::type cuda,
                     typename detail::NoDeduce<Args>::type... args) {
#if defined(FP8DP_WITH_CUDA)
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    cuda(args..., c10::cuda::getCurrentCUDAStream().stream());
    return;
  }
  FP8DP_CHECK(device.is_cpu(), "no kernel for tensors on ", device);
#else
  (void)cuda;
  FP8DP_CHECK(device.is_cpu(), "no kernel for tensors on ", device,
              " (this build of fp8dp has no CUDA)");
#endif
  install_aten_parallel_for();  // the CPU kernels' thread pool (common/parallel.h)
  cpu(args...);
}

}  // namespace fp8dp
