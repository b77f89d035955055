// The last step of the deterministic column reductions (the cast's dbias, the norm backward's
// dgamma / dbeta): out[c] = the sum over p of partial[p][c], added in order of p and rounded once
// to T, so the result depends only on the shape, not on timing. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_check.h"
#include "fp8/cuda/cast_common.cuh"

namespace fp8dp::cuda {

// One or two sums per launch (blockIdx.y picks one), so dgamma and dbeta share a launch.
template <typename T>
struct ColumnSums {
  const float* partial[2];  // [parts, cols] row-major each; [1] only with two sums
  T* out[2];                // [cols] each
  int64_t parts, cols;
};

template <typename T>
__global__ void column_sum_kernel(const ColumnSums<T> a) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= a.cols) return;
  const float* part = blockIdx.y == 0 ? a.partial[0] : a.partial[1];
  // Sixteen independent loads in flight per step; the adds stay in order (deterministic).
  constexpr int kUnroll = 16;
  float s = 0.0f;
  for (int64_t i0 = 0; i0 < a.parts; i0 += kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) v[j] = i0 + j < a.parts ? part[(i0 + j) * a.cols + c] : 0.0f;
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) s += v[j];
  }
  (blockIdx.y == 0 ? a.out[0] : a.out[1])[c] = from_float<T>(s);
}

// `sums` (1 or 2) column sums on `stream`, `threads` columns per block.
template <typename T>
void launch_column_sums(const ColumnSums<T>& a, int sums, int threads, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.cols + threads - 1) / threads),
                  static_cast<unsigned>(sums));
  column_sum_kernel<T><<<grid, threads, 0, stream>>>(a);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

}  // namespace fp8dp::cuda
