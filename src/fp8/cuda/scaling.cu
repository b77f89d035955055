// CUDA delayed-scaling update (same rules as update_scaling_cpu, scaling.h): reduce the amax
// history, compute scale / scale_inv and roll the history, for the n tensors of one [L, n] history
// (update_scaling_cuda) or for many such histories, one block each (update_scaling_batched_cuda,
// what update_fp8_scales uses: every FP8 module of a model in one launch).
#include <cuda_runtime.h>

#include <algorithm>
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

// Same rule as compute_scale() in scaling_cpu.cpp. exp2f of an integer margin is exact on host and
// device alike, so the scales match bit for bit; a fractional margin may differ in the last ulp.
__device__ __forceinline__ float device_scale(float amax, float fp8_max, float margin, float prev) {
  if (!(amax > 0.0f) || !isfinite(amax)) return prev;
  float s = fp8_max / amax / exp2f(margin);
  return isinf(s) ? FLT_MAX : s;
}

__global__ void __launch_bounds__(kCols* kRows)
    update_scaling_kernel(float* __restrict__ hist, float* __restrict__ scale,
                          float* __restrict__ scale_inv, const float* __restrict__ fp8_max,
                          int64_t n, int64_t L, bool use_max, float margin) {
  __shared__ float red[kRows][kCols];
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kCols + threadIdx.x;
  const bool active = t < n;
  // amax over the finite entries of rows 0..L-1 (kMax) or row 0 (kMostRecent): a NaN or Inf
  // amax is no observation (scaling.h), as in update_scaling_cpu.
  float m = 0.0f;
  if (active) {
    if (use_max) {
      for (int64_t i = threadIdx.y; i < L; i += kRows) m = finite_max(m, hist[i * n + t]);
    } else if (threadIdx.y == 0) {
      m = finite_max(0.0f, hist[t]);
    }
  }
  red[threadIdx.y][threadIdx.x] = m;
  __syncthreads();  // every read of the old history for the max is done before the roll writes
  // Roll from the top down: a step reads old rows [b - 1, b + kStep - 1) into registers, the block
  // syncs, then writes them to rows [b, b + kStep). Lower rows are read before any step overwrites
  // them.
  for (int64_t b = L - kStep; b > -kStep; b -= kStep) {
    float v[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t dst = b + threadIdx.y * kPerThread + j;
      v[j] = (active && dst >= 1 && dst < L) ? finite_or_zero(hist[(dst - 1) * n + t]) : 0.0f;
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
    for (int r = 1; r < kRows; ++r) amax = finite_max(amax, red[r][threadIdx.x]);
    const float s = device_scale(amax, fp8_max[t], margin, scale[t]);
    scale[t] = s;
    scale_inv[t] = 1.0f / s;
    hist[t] = 0.0f;
  }
}

// ---------------------------------------------------------------- batched: one block per slot
constexpr int kBatchThreads = 256;
constexpr int kRollPerThread = 8;

struct SlotBatch {
  ScalingSlot slot[kMaxSlotsPerLaunch];
};

// A slot's history is n * L contiguous floats, so rolling it by one row is a shift by n elements;
// the block shifts it top down in chunks of kBatchThreads * kRollPerThread (each chunk's reads land
// below every write made so far). Before that, thread t reduces column t % n over rows t / n,
// t / n + lanes, ... (lanes = kBatchThreads / n) for the max; the lane results meet in shared
// memory.
__global__ void __launch_bounds__(kBatchThreads)
    update_scaling_batched_kernel(const __grid_constant__ SlotBatch b) {
  __shared__ float red[kBatchThreads];
  const ScalingSlot& slot = b.slot[blockIdx.x];
  const ScalingUpdateParams& p = slot.params;
  const int64_t n = p.n, L = p.history_len, total = n * L;
  float* hist = p.amax_history;
  const int tid = threadIdx.x;
  if (slot.row0 != nullptr) {
    for (int64_t i = tid; i < n; i += kBatchThreads) hist[i] = slot.row0[i];
    __syncthreads();
  }
  const int64_t lanes = kBatchThreads / n;
  const int64_t col = tid % n, lane = tid / n;
  float m = 0.0f;
  if (lane < lanes) {
    if (p.algo == AmaxAlgo::kMax) {
      for (int64_t r = lane; r < L; r += lanes) m = finite_max(m, hist[r * n + col]);
    } else if (lane == 0) {
      m = finite_max(0.0f, hist[col]);
    }
  }
  red[tid] = m;
  __syncthreads();  // every read of the old history for the max is done before the roll writes
  if (tid < n) {
    float amax = red[tid];
    for (int64_t l = 1; l < lanes; ++l) amax = finite_max(amax, red[l * n + tid]);
    const float s = device_scale(amax, p.fp8_max[tid], p.margin, p.scale[tid]);
    p.scale[tid] = s;
    p.scale_inv[tid] = 1.0f / s;
  }
  constexpr int64_t kChunk = int64_t{kBatchThreads} * kRollPerThread;
  for (int64_t base = total - kChunk; base > -kChunk; base -= kChunk) {
    float v[kRollPerThread];
#pragma unroll
    for (int j = 0; j < kRollPerThread; ++j) {
      const int64_t dst = base + j * kBatchThreads + tid;
      v[j] = (dst >= n && dst < total) ? finite_or_zero(hist[dst - n]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kRollPerThread; ++j) {
      const int64_t dst = base + j * kBatchThreads + tid;
      if (dst >= n && dst < total) hist[dst] = v[j];
    }
    __syncthreads();
  }
  if (tid < n) hist[tid] = 0.0f;
}

__global__ void current_scale_kernel(const float* __restrict__ amax, float* __restrict__ scale,
                                     float fp8_max, float margin) {
  *scale = device_scale(*amax, fp8_max, margin, 1.0f);
}

}  // namespace
}  // namespace cuda

void update_scaling_batched_cuda(const ScalingSlot* slots, int64_t count, void* stream) {
  FP8DP_CHECK(count >= 0, "update_scaling_batched: count must be >= 0, got ", count);
  for (int64_t i = 0; i < count; ++i) {
    const ScalingUpdateParams& p = slots[i].params;
    FP8DP_CHECK(p.history_len >= 1, "update_scaling_batched: slot ", i,
                ": history_len must be >= 1, got ", p.history_len);
    FP8DP_CHECK(p.n >= 1 && p.n <= cuda::kBatchThreads, "update_scaling_batched: slot ", i,
                ": n must be in [1, ", cuda::kBatchThreads, "], got ", p.n);
  }
  for (int64_t first = 0; first < count; first += kMaxSlotsPerLaunch) {
    const int64_t k = std::min<int64_t>(kMaxSlotsPerLaunch, count - first);
    cuda::SlotBatch b;
    std::copy(slots + first, slots + first + k, b.slot);
    cuda::update_scaling_batched_kernel<<<static_cast<unsigned>(k), cuda::kBatchThreads, 0,
                                          static_cast<cudaStream_t>(stream)>>>(b);
    FP8DP_CHECK_CUDA(cudaGetLastError());
  }
}

void current_scale_cuda(const float* amax, float* scale, float fp8_max, float margin,
                        void* stream) {
  cuda::current_scale_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(amax, scale, fp8_max,
                                                                             margin);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

void update_scaling_cuda(const ScalingUpdateParams& p, void* stream) {
  FP8DP_CHECK(p.history_len >= 1, "update_scaling: history_len must be >= 1, got ", p.history_len);
  FP8DP_CHECK(p.n >= 0, "update_scaling: n must be >= 0, got ", p.n);
  if (p.n == 0) return;
  const unsigned blocks = static_cast<unsigned>((p.n + cuda::kCols - 1) / cuda::kCols);
  cuda::update_scaling_kernel<<<blocks, dim3(cuda::kCols, cuda::kRows), 0,
                                static_cast<cudaStream_t>(stream)>>>(
      p.amax_history, p.scale, p.scale_inv, p.fp8_max, p.n, p.history_len, p.algo == AmaxAlgo::kMax,
      p.margin);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

}  // namespace fp8dp
