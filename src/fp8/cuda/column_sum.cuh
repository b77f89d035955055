// The last step of the deterministic column reductions (the cast's dbias, the norm backward's
// dgamma / dbeta): out[c] = the sum over p of partial[p][c], rounded once to T. The order of the
// additions is fixed by the shape alone (slice k adds the parts k, k + kSlices, ... in order, then
// the kSlices slice sums are added in slice order), so the result does not depend on timing, nor
// on whether a kernel of its own or the kernel that wrote the parts adds them (the LayerNorm
// backward's cooperative launch).
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

// A group of kSumSlices warps covers 32 columns (one 128-byte row segment per warp load), each warp
// summing every kSumSlices-th part: a few hundred parts of a few thousand columns spread over every
// SM instead of leaving one thread per column to walk all the parts in sequence.
constexpr int kSumCols = 32;
constexpr int kSumSlices = 8;
constexpr int kSumThreads = kSumCols * kSumSlices;  // threads of one summing group

// Shared memory of one group: the slice sums (+1 column of padding, as every [rows][32] float
// tile here has).
using ColumnSumSlices = float[kSumSlices][kSumCols + 1];

// The sum over parts of the 32 columns c0 .. c0 + 31 of part[parts, cols], computed by one group
// of kSumThreads threads: t in [0, kSumThreads) is the thread's index within its group and `slices`
// the group's own shared buffer. Returns the sum of column c0 + t to the threads t < kSumCols (0
// where c0 + t >= cols); other threads get an unspecified value.
//
// The parts are read with __ldcg (L2, not L1 or the read-only path): in the fused use they were
// written by other blocks of the same kernel, which the non-coherent caches need not see.
//
// Barrier discipline: the function contains one __syncthreads(), so every thread of the block
// must make the same number of calls, each group with its own `slices` (a 512-thread block
// running two groups calls it from both, passing t = threadIdx.x % kSumThreads). Before a group
// reuses `slices` for a second call, the block must pass another __syncthreads(): the threads
// t < kSumCols may still be reading it.
__device__ __forceinline__ float column_tile_sum(const float* part, int64_t parts, int64_t cols,
                                                 int64_t c0, int t, ColumnSumSlices& slices) {
  const int tx = t % kSumCols, ty = t / kSumCols;
  const int64_t c = c0 + tx;
  float s = 0.0f;
  if (c < cols) {
    // Eight independent loads in flight per step; the adds stay in part order (so the bits do not
    // depend on kUnroll). The sum is a chain of L2 round trips: in the LayerNorm backward's
    // cooperative tail (132-264 parts) it is a fixed cost of every call, which the GPT stack's
    // shapes (4096 rows) do not amortise.
    constexpr int kUnroll = 8;
    for (int64_t i0 = ty; i0 < parts; i0 += kSumSlices * kUnroll) {
      float v[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t i = i0 + static_cast<int64_t>(j) * kSumSlices;
        v[j] = i < parts ? __ldcg(part + i * cols + c) : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) s += v[j];
    }
  }
  slices[ty][tx] = s;
  __syncthreads();
  float total = 0.0f;
  if (ty == 0) {
#pragma unroll
    for (int k = 0; k < kSumSlices; ++k) total += slices[k][tx];
  }
  return total;
}

template <typename T>
__global__ void __launch_bounds__(kSumThreads) column_sum_kernel(const ColumnSums<T> a) {
  __shared__ ColumnSumSlices slices;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kSumCols;
  const float* part = blockIdx.y == 0 ? a.partial[0] : a.partial[1];
  const float s = column_tile_sum(part, a.parts, a.cols, c0, threadIdx.x, slices);
  const int64_t c = c0 + threadIdx.x;
  if (threadIdx.x < kSumCols && c < a.cols)
    (blockIdx.y == 0 ? a.out[0] : a.out[1])[c] = from_float<T>(s);
}

// `sums` (1 or 2) column sums on `stream`.
template <typename T>
void launch_column_sums(const ColumnSums<T>& a, int sums, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.cols + kSumCols - 1) / kSumCols),
                  static_cast<unsigned>(sums));
  column_sum_kernel<T><<<grid, kSumThreads, 0, stream>>>(a);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

}  // namespace fp8dp::cuda
