// The last step of the deterministic column reductions (the cast's dbias, the norm backward's
// dgamma / dbeta): out[c] = the sum over p of partial[p][c], rounded once to T. The order of the
// additions is fixed by the shape alone (slice k adds the parts k, k + kSlices, ... in order, then
// the kSlices slice sums are added in slice order), so the result does not depend on timing.
// Torch-free.
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

// A block covers 32 columns (one 128-byte row segment per warp load) with kSlices warps, each
// summing every kSlices-th part: a few hundred parts of a few thousand columns spread over every
// SM instead of leaving one thread per column to walk all the parts in sequence.
constexpr int kSumCols = 32;
constexpr int kSumSlices = 8;

template <typename T>
__global__ void __launch_bounds__(kSumCols* kSumSlices) column_sum_kernel(const ColumnSums<T> a) {
  __shared__ float slice_sum[kSumSlices][kSumCols + 1];
  const int tx = threadIdx.x % kSumCols, ty = threadIdx.x / kSumCols;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kSumCols + tx;
  const float* part = blockIdx.y == 0 ? a.partial[0] : a.partial[1];
  float s = 0.0f;
  if (c < a.cols) {
    // Four independent loads in flight per step; the adds stay in part order.
    constexpr int kUnroll = 4;
    for (int64_t i0 = ty; i0 < a.parts; i0 += kSumSlices * kUnroll) {
      float v[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t i = i0 + static_cast<int64_t>(j) * kSumSlices;
        v[j] = i < a.parts ? part[i * a.cols + c] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) s += v[j];
    }
  }
  slice_sum[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && c < a.cols) {
    float t = 0.0f;
#pragma unroll
    for (int k = 0; k < kSumSlices; ++k) t += slice_sum[k][tx];
    (blockIdx.y == 0 ? a.out[0] : a.out[1])[c] = from_float<T>(t);
  }
}

// `sums` (1 or 2) column sums on `stream`.
template <typename T>
void launch_column_sums(const ColumnSums<T>& a, int sums, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.cols + kSumCols - 1) / kSumCols),
                  static_cast<unsigned>(sums));
  column_sum_kernel<T><<<grid, kSumCols * kSumSlices, 0, stream>>>(a);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

}  // namespace fp8dp::cuda
