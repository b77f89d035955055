// What the CUDA GoogleTests share: a test skips (rather than fails) on a machine without a GPU,
// so CI without one stays green while the GPU machine runs every case.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

namespace fp8dp::test {

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace fp8dp::test

#define SKIP_WITHOUT_GPU() \
  if (!::fp8dp::test::have_gpu()) GTEST_SKIP() << "no CUDA device visible"
