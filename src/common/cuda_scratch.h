// Stream-ordered scratch memory for the kernels below LibTorch (the cast's dbias partial sums, the
// norm backward's partial rows), from one private memory pool per device that keeps what it has
// reserved. Include only from CUDA builds.
//
// Why not plain cudaMallocAsync: it draws from the device's default pool, whose release threshold
// is 0, so every synchronisation (a training loop's loss.item() each step) hands the pool's free
// memory back to the driver, and the next allocation maps memory again. On the H200 machine that
// one call took 238 us of host time right after a synchronize, a quarter of the enqueue time of an
// FP8 Linear 4096^3 step (dev/host_profile.py). A private pool leaves the process's default pool
// as it was. Why not one cached buffer per stream, as the cuBLASLt workspace: a buffer that had to
// grow would be freed under a CUDA graph that captured it, while allocations from a pool made
// during capture become the graph's own. The cost: the pool keeps the most scratch ever in flight
// at once on the device (the norm backward's two partial rows of up to 2 x 132 blocks at 8192
// columns: 17 MB), outside torch's allocator and its statistics.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "common/cuda_check.h"

namespace fp8dp::cuda {

// The current device's scratch pool, created on first use and never destroyed (kernels may use it
// until the process exits).
inline cudaMemPool_t scratch_pool() {
  int dev = 0;
  FP8DP_CHECK_CUDA(cudaGetDevice(&dev));
  static std::mutex mu;
  static std::vector<cudaMemPool_t> pools;
  std::lock_guard<std::mutex> lock(mu);
  if (pools.size() <= static_cast<size_t>(dev)) pools.resize(dev + 1, nullptr);
  if (pools[dev] == nullptr) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = dev;
    cudaMemPool_t pool = nullptr;
    FP8DP_CHECK_CUDA(cudaMemPoolCreate(&pool, &props));
    uint64_t keep = UINT64_MAX;  // never trim at a synchronisation
    FP8DP_CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    pools[dev] = pool;
  }
  return pools[dev];
}

// `count` elements of T, usable by work enqueued on `st` after this call; give them back with
// scratch_free on the same stream once that work is enqueued.
template <typename T>
T* scratch_alloc(size_t count, cudaStream_t st) {
  void* p = nullptr;
  FP8DP_CHECK_CUDA(cudaMallocFromPoolAsync(&p, count * sizeof(T), scratch_pool(), st));
  return static_cast<T*>(p);
}

inline void scratch_free(void* p, cudaStream_t st) { FP8DP_CHECK_CUDA(cudaFreeAsync(p, st)); }

}  // namespace fp8dp::cuda
