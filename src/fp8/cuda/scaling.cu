// CUDA delayed-scaling update: for every tensor of a step, in one launch, reduce the amax history,
// compute scale / scale_inv and roll the history (same rules as update_scaling_cpu, scaling.h).
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "common/cuda_check.h"
#include "fp8/scaling.h"

namespace fp8dp {
namespace cuda {
namespace {

// A block owns kCols tensors (one per threadIdx.x, so history rows are read coalesced) and kRows
// threads per tensor that walk the history kRows * kPerThread rows at a time.
constexpr int kCols = 32;
constexpr int kRows = 8;
constexpr int kPerThread = 8;
constexpr int kStep = kRows * kPerThread;

__device__ __forceinline__ float nan_max(float m, float a) { return (a != a || a > m) ? a : m; }

// Same rule as compute_scale() in scaling_cpu.cpp. exp2f of an integer margin is exact on host and
// device alike, so the scales match bit for bit; a fractional margin may differ in the last ulp.
__device__ __forceinline__ float device_scale(float amax, float fp8_max, float margin, float prev) {
  if (!(amax > 0.0f) || !isfinite(amax)) return prev;
  float s = fp8_max / amax / exp2f(margin);
  return isinf(s) ? FLT_MAX : s;
}

__global__ void __launch_bounds__(kCols* kRows)
    update_scaling_kernel(float* __restrict__ hist, float* __restrict__ scale,
                          float* __restrict__ scale_inv, const float* __restrict__ fp8_max, int64_t n,
                          int64_t L, bool use_max, float margin) {
  __shared__ float red[kRows][kCols];
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kCols + threadIdx.x;
  const bool active = t < n;
  // amax over rows 0..L-1 (kMax) or row 0 (kMostRecent); NaN wins.
  float m = 0.0f;
  if (active) {
    if (use_max) {
      for (int64_t i = threadIdx.y; i < L; i += kRows) m = nan_max(m, hist[i * n + t]);
    } else if (threadIdx.y == 0) {
      m = hist[t];
    }
  }
  red[threadIdx.y][threadIdx.x] = m;
  __syncthreads();  // every read of the old history for the max is done before the roll writes
  // Roll from the top down: a step reads old rows [b - 1, b + kStep - 1) into registers, the block
  // syncs, then writes them to rows [b, b + kStep). Lower rows are read before any step overwrites them.
  for (int64_t b = L - kStep; b > -kStep; b -= kStep) {
    float v[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t dst = b + threadIdx.y * kPerThread + j;
      v[j] = (active && dst >= 1 && dst < L) ? hist[(dst - 1) * n + t] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t dst = b + threadIdx.y * kPerThread + j;
      if (active && dst >= 1 && dst < L) hist[dst * n + t] = v[j];
    }
    __syncthreads();
  }
  if (active && threadIdx.y == 0) {
    float amax = red[0][threadIdx.x];
#pragma unroll
    for (int r = 1; r < kRows; ++r) amax = nan_max(amax, red[r][threadIdx.x]);
    const float s = device_scale(amax, fp8_max[t], margin, scale[t]);
    scale[t] = s;
    scale_inv[t] = 1.0f / s;
    hist[t] = 0.0f;
  }
}

}  // namespace
}  // namespace cuda

void update_scaling_cuda(const ScalingUpdateParams& p, void* stream) {
  FP8DP_CHECK(p.history_len >= 1, "update_scaling: history_len must be >= 1, got ", p.history_len);
  FP8DP_CHECK(p.n >= 0, "update_scaling: n must be >= 0, got ", p.n);
  if (p.n == 0) return;
  const unsigned blocks = static_cast<unsigned>((p.n + cuda::kCols - 1) / cuda::kCols);
  cuda::update_scaling_kernel<<<blocks, dim3(cuda::kCols, cuda::kRows), 0,
                                static_cast<cudaStream_t>(stream)>>>(
      p.amax_history, p.scale, p.scale_inv, p.fp8_max, p.n, p.history_len,
      p.algo == AmaxAlgo::kMax, p.margin);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

}  // namespace fp8dp
