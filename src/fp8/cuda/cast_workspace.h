// Scratch memory of the CUDA cast-transpose kernel (dbias per-strip column sums; amax accumulator
// and arrival counters), cached per (device, stream) so that a cast allocates and clears nothing in
// the common case. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>

namespace fp8dp::cuda {

struct CastWorkspace {
  float* partial = nullptr;          // at least the floats asked for; contents undefined
  unsigned int* counters = nullptr;  // at least the counters asked for; zero between kernels
};

// The workspace of (current device, st), grown to at least `partial_floats` floats and `counters`
// counters. Growing is stream-ordered (cudaFreeAsync / cudaMallocAsync on st), so kernels already
// enqueued on st finish with the old buffers first; new counters are zeroed on st. Kernels must
// leave the counters zero (the last block to arrive resets each), which the stream order then hands
// to the next kernel on st. On return `lock` holds the cache's mutex: keep it until the kernels
// using the workspace are enqueued, so that no other host thread can grow (free) the buffers in
// between.
CastWorkspace cast_workspace(cudaStream_t st, size_t partial_floats, size_t counters,
                             std::unique_lock<std::mutex>& lock);

}  // namespace fp8dp::cuda
